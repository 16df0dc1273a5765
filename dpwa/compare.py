"""python -m dpwa.compare: the command's short name; the code is dpwa.lab.compare (the lab, apart from the library)"""

import runpy

if __name__ == "__main__":
    runpy.run_module("dpwa.lab.compare", run_name="__main__", alter_sys=True)

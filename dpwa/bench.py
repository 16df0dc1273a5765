"""python -m dpwa.bench: the command's short name; the code is dpwa.lab.bench (the lab, apart from the library)"""

import runpy

if __name__ == "__main__":
    runpy.run_module("dpwa.lab.bench", run_name="__main__", alter_sys=True)

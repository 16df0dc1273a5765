"""python -m dpwa.compare: kept working; the comparison is the lab's ``python -m dpwa_lab.compare`` (lab/, dpwa-lab)"""

from .labcommand import run_lab

if __name__ == "__main__":
    run_lab("dpwa_lab.compare", "python -m dpwa.compare")

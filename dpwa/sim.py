"""python -m dpwa.sim: kept working; the simulator is the lab's ``python -m dpwa_lab.sim`` (lab/, dpwa-lab)"""

from .labcommand import run_lab

if __name__ == "__main__":
    run_lab("dpwa_lab.sim", "python -m dpwa.sim")

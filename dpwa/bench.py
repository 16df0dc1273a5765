"""python -m dpwa.bench: kept working; the benchmark is the lab's ``python -m dpwa_lab.bench`` (lab/, dpwa-lab)"""

from .labcommand import run_lab

if __name__ == "__main__":
    run_lab("dpwa_lab.bench", "python -m dpwa.bench")

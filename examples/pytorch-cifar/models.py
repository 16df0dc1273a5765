"""Models of the example: a small ResNet for CPU cores and the pre-activation ResNet-18 for GPUs.

They are :mod:`dpwa_lab.workloads.images`'s (the comparison trains the same).

    .venv/bin/python examples/pytorch-cifar/models.py      # prints each model's size
"""

from __future__ import annotations

from dpwa_lab.workloads.images import MODELS, build, count_parameters

__all__ = ["MODELS", "build", "count_parameters"]

if __name__ == "__main__":
    for model in MODELS:
        print(f"{model}: {count_parameters(build(model, 3)):,} parameters")

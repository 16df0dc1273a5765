"""Pure math over numbers and flat arrays: no sockets, no threads.

* :mod:`.kernels`: in-place blends, encodings and checks over flat buffers;
* :mod:`.interpolation`: how the factor f is chosen (constant, clock, loss);
* :mod:`.rules`: how an exchange changes each side (pull or symmetric, state or delta);
* :mod:`.outer`: the outer optimizer on a pseudo-gradient after local steps (DiLoCo's Nesterov step).
"""

"""Engine emulator: fake SGLang/vLLM/TRT-LLM replicas that speak the engines' real wire formats.

:mod:`replicas.wire` holds the pure encoders; they are written independently of the balancer's decoders
(``balancer.engines``) so that round-trip tests catch drift between the two.
"""

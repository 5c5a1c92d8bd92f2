"""The machine under everything: which device and dtype run (device.py), which BLAS MLX's Linux
CPU matmuls call and the small compiled dispatch that routes them (blas.py and its C files),
the fused kernels MLX's CPU backend lacks (fastmath.py), the one long-lived thread MLX
work off the main thread belongs on (mlx_thread.py), and all that in words (process.py).
Imports only the errors and limits."""

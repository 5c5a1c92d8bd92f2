"""The machine under everything: which device and dtype run (device.py), which BLAS MLX's Linux
CPU matmuls call and the small compiled dispatch that routes them (blas.py and its C files),
the operations around the products chosen once per device and settings (backend.py: on the
CPU the single C++ nodes of nodes.py and the compiled kernels of fastmath.py, which MLX's CPU
backend lacks; fused.py forwards model code to it), the one long-lived thread MLX work off the
main thread belongs on (mlx_thread.py), and all that in words (process.py).
Imports only the errors, limits and settings."""

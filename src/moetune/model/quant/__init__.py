"""An FP8 frozen base: storage formats (fp8.py), matmuls through fp8 weights (matmul.py), fp8 modules and turning a
model's frozen weights into them (modules.py), reading the hub's FP8 checkpoints (checkpoint.py)."""

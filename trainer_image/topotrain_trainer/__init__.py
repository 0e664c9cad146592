"""topotrain's bundled trainer: 3D-parallel Llama-style training with async S3 checkpoints."""

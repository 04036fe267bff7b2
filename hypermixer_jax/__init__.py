"""hypermixer-jax: MLP-based alternatives to Transformers in JAX/Flax."""

__version__ = "0.1.0"

"""hypermixer-jax: MLP-based alternatives to Transformers in JAX/Flax."""
import setuptools

INSTALL_REQUIRES = [
    "jax>=0.9",
    "jaxlib>=0.9",
    "flax>=0.11",
    "optax>=0.2.4",
    "orbax-checkpoint>=0.11",
    "chex>=0.1.90",
    "ml_collections>=1.0",
    "absl-py",
    "numpy",
    # Input pipelines (CPU tf is what seqio/TFDS need on the host).
    "tensorflow",       # CPU use only (hypermixer_jax.runtime hides GPUs)
    "tensorflow-datasets>=4.9",
    "tensorflow-text",  # pins its own tensorflow release line
    "seqio>=0.0.19",
    "sentencepiece",
    # Metrics and visualisation.
    "tensorboardX",
    "matplotlib",
    "tqdm",
]

# gs:// workdirs: epath's gcsfs backend and the workdir lock's
# google-cloud-storage, against a local GCS emulator.
GCS_REQUIRE = ["google-cloud-storage"]
TESTS_REQUIRE = ["pytest", "pytest-xdist", "gcp-storage-emulator", "gcsfs",
                 *GCS_REQUIRE]

# Accelerator builds of jax (its own extras name the matching jaxlib and the
# TPU runtime / CUDA plugin). A plain install gets the CPU jaxlib. Install
# with ``-c constraints.txt`` (the tested versions of every package, the
# extras' dependencies included), all extras in one command:
#   pip install -e ".[test,tpu]" -c constraints.txt
EXTRAS_REQUIRE = {
    "test": TESTS_REQUIRE,
    "tpu": ["jax[tpu]>=0.9"],            # Cloud TPU VMs (libtpu)
    # gs:// workdirs (the workdir lock's client; files go through epath).
    "gcs": GCS_REQUIRE,
    "cuda12": ["jax[cuda12]>=0.9"],      # NVIDIA GPUs, CUDA 12 wheels from pip
    "cuda13": ["jax[cuda13]>=0.9"],      # NVIDIA GPUs, CUDA 13 wheels from pip
    # Viewing profiler traces (config.profile) in TensorBoard / XProf.
    "profile": ["xprof", "tensorboard"],
    # Viewing the runs' TensorBoard event files (WORKDIR/tensorboard).
    "tensorboard": ["tensorboard"],
}

setuptools.setup(
    name="hypermixer_jax",
    version="0.1.0",
    description="HyperMixer, MLP-Mixer, gMLP/aMLP, sMLP and baselines in JAX/Flax",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=setuptools.find_packages(include=["hypermixer_jax", "hypermixer_jax.*"]),
    python_requires=">=3.11",
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points={"console_scripts": ["hypermixer-train=hypermixer_jax.main:run"]},
)

"""The embedded default job: HyperMixer on the HyperMixer paper's synthetic task.

Needs no download (the data are generated) and finishes in a few minutes on
two CPU cores. Each position of a 1-d sequence of shape pairs must output the
mean height of the two objects of its own shape (Mai et al. 2023, §4.7).
Every model (and every control, which shares all but the mixer settings) has
a 1-d convolutional stem (``model.conv_stem``, kernels 5, 5) that detects the
shapes locally, as the convolutions of Fleuret's original toy model do, so
the token mixer only has to pair the objects; ``--config.model.conv_stem=()``
turns it off.

    python -m hypermixer_jax.main --config=configs/default.py --workdir=/tmp/hm

The run ends with the pseudo-attention map of the trained model
(``<workdir>/pseudo_attention.png``, a declared evaluator:
``config.evals.pseudo_attention``). The comparison with the controls
(MLP-Mixer, attention, no token mixing) is an experiment: see
experiments/README.md.

Arguments (``--config=configs/default.py:ARG``): a mixer name (``hypermixer``,
``mlp_mixer``, ``attention``, ``none``) to train that model instead.
"""
import ml_collections

from hypermixer_jax import models
from hypermixer_jax.train.config import base_config


def get_config(arg: str = "") -> ml_collections.ConfigDict:
  mixer = arg or "hypermixer"
  c = base_config()
  c.data.task = "synthetic_pairs"
  c.data.synthetic.seq_len = 64
  c.data.synthetic.num_examples = 0        # endless fresh examples
  c.data.synthetic.num_eval_examples = 1024

  c.model = models.get_model_config(f"synthetic_{mixer}")
  c.model.max_len = c.data.synthetic.seq_len

  c.mesh.data = -1
  c.sharding.rules = "data_parallel"

  c.learning_rate = 3e-3
  c.warmup_steps = 100
  c.decay = "cosine"
  c.weight_decay = 0.0
  c.clip_norm = 1.0
  c.num_train_steps = 1500
  c.batch_size = 64
  c.eval_batch_size = 256
  c.eval_every = 500
  c.eval_steps = -1                        # the whole validation split
  c.log_every = 50
  c.checkpoint_every = 500
  # At least 2: a step damaged after it was written (found on restore by its
  # fingerprints) then leaves an older one to resume from; 1 keeps none.
  c.keep_checkpoints = 2

  # At the end of training: the map of the first validation example.
  c.evals.pseudo_attention = ml_collections.ConfigDict(
      dict(type="pseudo_attention", every=0))
  return c

"""ImageNet-1k classification of MLP-Mixer and gMLP (patches from the pipeline).

    python -m hypermixer_jax.main --config=configs/imagenet.py:gmlp_s \
        --workdir=/ckpt/gmlp_s

Argument: a zoo image model (``mixer_s16``, ``mixer_b16``, ``mixer_b32``,
``gmlp_ti``, ``gmlp_s``, ``gmlp_b``, ``vit_ti16``). DeiT-style recipe of the gMLP paper
(AdamW, batch 4096, lr 1e-3 with 10k warm-up steps and cosine decay, weight
decay 0.05, 300 epochs); the ``fsdp`` rules on an all-data mesh
(``mesh.fsdp=1``: parameters replicated; ``--config.mesh.fsdp=N`` shards
them over N devices), bf16 compute on TPU / GPU (the
precision policy, ``model.dtype='auto'``). ViT-style peer of
gMLP-Ti: ``vit_ti16`` (DeiT-Ti layout).

CIFAR-10 with the same models, pipeline and recipe is one flag away:
``--config=configs/cifar10.py:<model>`` (see that file).
"""
import ml_collections

from hypermixer_jax import models
from hypermixer_jax.train.config import base_config

TRAIN_IMAGES = 1_281_167


def get_config(arg: str = "gmlp_s") -> ml_collections.ConfigDict:
  c = base_config()
  c.model = models.get_model_config(arg or "gmlp_s")
  c.model.dropout_rate = 0.0
  c.data.task = "imagenet_patches"
  c.data.num_classes = c.model.num_classes = 1000
  c.data.image_size = 224
  # The model consumes flattened patches [B, N, P*P*3] from the pipeline.
  c.data.patch_size = int(round((c.model.input_dim // 3) ** 0.5))
  c.model.patch_size = 0

  c.mesh.data = -1
  c.mesh.fsdp = 1
  c.sharding.rules = "fsdp"

  c.batch_size = 4096
  c.eval_batch_size = 1000
  c.num_train_steps = 300 * TRAIN_IMAGES // c.batch_size
  c.learning_rate = 1e-3
  c.warmup_steps = 10_000
  c.decay = "cosine"
  c.weight_decay = 0.05
  c.clip_norm = 1.0
  c.eval_every = 5_000
  c.eval_steps = -1
  c.log_every = 100
  c.checkpoint_every = 5_000
  c.keep_checkpoints = 3
  return c

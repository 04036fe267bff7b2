"""CIFAR-10 classification of the image models, through the ImageNet pipeline.

    python -m hypermixer_jax.data.prepare_images \
        --archive=../shared/data/cifar10/cifar10_jpeg_train_test.tar.gz \
        --out=/data/cifar10
    python -m hypermixer_jax.main --config=configs/cifar10.py:gmlp_ti \
        --workdir=/ckpt/cifar_gmlp_ti \
        --config.data.local_files.train=/data/cifar10/train.tsv \
        --config.data.local_files.validation=/data/cifar10/test.tsv

One flag away from ImageNet-1k: ``--config=configs/imagenet.py:gmlp_ti`` is
the same model (depth, width, blocks) at the paper's 224x224 / 16x16 with
1000 classes, the paper's DeiT-style recipe and TFDS ``imagenet2012``. This
file starts from that config and changes only the data (32x32 JPEGs of
``data.local_files``, 4x4 patches, 10 classes, CIFAR augmentation), the
model's input layout that follows from it (``max_len`` 64 patches,
``input_dim`` 48, ``num_classes`` 10) and the schedule (batch 128, 200 epochs
of 50,000 images, 5 warm-up epochs, evaluation of 200-image batches and a
checkpoint every 10 epochs).

Argument: any zoo image model (``gmlp_ti``, ``gmlp_s``, ``mixer_s16``,
``mixer_cifar``, ``vit_ti16``, ``vit_cifar``, ...). At 32x32 / 4x4,
``gmlp_ti`` has 4.61M parameters, ``vit_cifar`` 4.77M, ``mixer_cifar`` 4.49M.

Augmentation: the ImageNet random-resized crop keeps at least 8% of the
image, too strong for 32x32; here ``data.min_crop_area = 0.35`` (our choice)
and the horizontal flip; evaluation takes the whole image
(``crop_fraction = 1``, no resize).
"""
import importlib.util
import os

import ml_collections

TRAIN_IMAGES = 50_000
IMAGE_SIZE, PATCH = 32, 4


def _imagenet_config(arg: str) -> ml_collections.ConfigDict:
  spec = importlib.util.spec_from_file_location(
      "_imagenet_config", os.path.join(os.path.dirname(__file__),
                                       "imagenet.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def get_config(arg: str = "gmlp_ti") -> ml_collections.ConfigDict:
  c = _imagenet_config(arg or "gmlp_ti")
  c.data.image_size = IMAGE_SIZE
  c.data.patch_size = PATCH
  c.data.num_classes = 10
  c.data.min_crop_area = 0.35
  c.data.crop_fraction = 1.0
  c.model.max_len = (IMAGE_SIZE // PATCH) ** 2
  c.model.input_dim = PATCH * PATCH * 3
  c.model.num_classes = 10

  c.batch_size = 128
  c.eval_batch_size = 200
  c.num_train_steps = 200 * TRAIN_IMAGES // c.batch_size
  c.warmup_steps = 5 * TRAIN_IMAGES // c.batch_size
  c.eval_every = 10 * TRAIN_IMAGES // c.batch_size
  c.checkpoint_every = c.eval_every
  return c

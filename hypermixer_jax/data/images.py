"""ImageNet preprocessing for the Mixer and gMLP vision models (tf.data).

Training: Inception-style random resized crop (area in [min_crop_area, 1],
aspect ratio in [3/4, 4/3]) and a horizontal flip, both stateless and seeded
through seqio. Evaluation: resize the shorter side to
``image_size / crop_fraction`` and take the centre ``image_size`` crop. Then
ImageNet mean/std normalisation and cutting into non-overlapping P×P patches,
flattened row-major as ``(p_row, p_col, channel)`` — the order of a P×P,
stride-P convolution kernel — giving ``inputs: f32 [N, P*P*3]``.
"""
from __future__ import annotations

import seqio
import tensorflow as tf

from hypermixer_jax.data import sources

MEAN_RGB = (0.485, 0.456, 0.406)
STDDEV_RGB = (0.229, 0.224, 0.225)


def random_resized_crop(image_bytes: tf.Tensor, seed: tf.Tensor, size: int,
                        min_area: float) -> tf.Tensor:
  """Decodes only the sampled crop of a JPEG and resizes it to size×size."""
  shape = tf.io.extract_jpeg_shape(image_bytes)
  begin, crop_size, _ = tf.image.stateless_sample_distorted_bounding_box(
      shape, bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]), seed=seed,
      min_object_covered=0.0, aspect_ratio_range=(3 / 4, 4 / 3),
      area_range=(min_area, 1.0), max_attempts=10,
      use_image_if_no_bounding_boxes=True)
  window = tf.stack([begin[0], begin[1], crop_size[0], crop_size[1]])
  image = tf.image.decode_and_crop_jpeg(image_bytes, window, channels=3)
  return tf.image.resize(image, [size, size], method="bicubic")


def resize_centre_crop(image_bytes: tf.Tensor, size: int,
                       crop_fraction: float) -> tf.Tensor:
  image = tf.io.decode_image(image_bytes, channels=3, expand_animations=False)
  shape = tf.cast(tf.shape(image)[:2], tf.float32)
  scale = (size / crop_fraction) / tf.reduce_min(shape)
  resized = tf.cast(tf.round(shape * scale), tf.int32)
  image = tf.image.resize(image, resized, method="bicubic")
  top = (resized[0] - size) // 2
  left = (resized[1] - size) // 2
  return image[top:top + size, left:left + size]


def normalize(image: tf.Tensor) -> tf.Tensor:
  image = tf.clip_by_value(image, 0.0, 255.0) / 255.0
  return (image - tf.constant(MEAN_RGB)) / tf.constant(STDDEV_RGB)


def to_patches(image: tf.Tensor, patch: int) -> tf.Tensor:
  """[H, W, C] -> [H/P * W/P, P*P*C], patches in row-major order."""
  h, w, c = image.shape
  x = tf.reshape(image, [h // patch, patch, w // patch, patch, c])
  x = tf.transpose(x, [0, 2, 1, 3, 4])
  return tf.reshape(x, [(h // patch) * (w // patch), patch * patch * c])


def check_jpeg(image_bytes: tf.Tensor, source: tf.Tensor | str
               ) -> tf.Operation:
  """Refuses a file that is not a whole JPEG, naming where it came from.

  A JPEG starts with the SOI marker FFD8 and ends with EOI FFD9 (allowing a
  few bytes of trailing padding); a truncated or overwritten file fails
  here, with the TSV file and line, instead of inside the decoder
  (``jpeg::Uncompress failed``, which names nothing).
  """
  n = tf.strings.length(image_bytes)
  soi = tf.equal(tf.strings.substr(image_bytes, 0, 2), b"\xff\xd8")
  eoi = tf.reduce_any([tf.equal(tf.strings.substr(
      image_bytes, tf.maximum(n - k, 0), 2), b"\xff\xd9")
                       for k in range(2, 34)])
  return sources.data_check(
      soi & eoi, source, ": not a complete JPEG (", tf.strings.as_string(n),
      " bytes, ", tf.where(soi, "ends without the EOI marker",
                           "does not start with the SOI marker"),
      "); the file is truncated or corrupt: replace it or drop its row.")


def preprocess(ds: tf.data.Dataset, *, train: bool, image_size: int,
               patch_size: int, min_crop_area: float,
               crop_fraction: float) -> tf.data.Dataset:
  """{'image': JPEG bytes, 'label'} -> {'inputs': patches, 'label': int32}."""
  @seqio.map_over_dataset(num_seeds=1)
  def fn(ex, seed):
    check = check_jpeg(ex["image"], ex.get("source", "an image of the TFDS "
                                                     "dataset"))
    with tf.control_dependencies([check]):
      ex = {**ex, "image": tf.identity(ex["image"])}
    if train:
      crop_seed, flip_seed = tf.unstack(
          tf.random.experimental.stateless_split(seed, 2))
      image = random_resized_crop(ex["image"], crop_seed, image_size,
                                  min_crop_area)
      image = tf.image.stateless_random_flip_left_right(image, flip_seed)
    else:
      image = resize_centre_crop(ex["image"], image_size, crop_fraction)
    image.set_shape([image_size, image_size, 3])
    return {"inputs": to_patches(normalize(image), patch_size),
            "label": tf.cast(ex["label"], tf.int32)}
  return fn(ds)

"""ImageNet preprocessing for the Mixer and gMLP vision models (tf.data).

Training: Inception-style random resized crop (area in [min_crop_area, 1],
aspect ratio in [3/4, 4/3]) and a horizontal flip, both stateless and seeded
through seqio (``min_crop_area=1`` keeps the whole image: only the flip). Evaluation: resize the shorter side to
``image_size / crop_fraction`` and take the centre ``image_size`` crop. Then
normalisation (``NORMALIZATIONS``: ImageNet mean/std, or the Inception-style
``(x - 127.5) / 127.5`` of the official MLP-Mixer/ViT releases) and cutting into non-overlapping P×P patches,
flattened row-major as ``(p_row, p_col, channel)`` — the order of a P×P,
stride-P convolution kernel — giving ``inputs: f32 [N, P*P*3]``.

Bad input stops the pipeline with a ``DataError`` naming the example's
source (labels TSV file and line, or TFDS record): a file that is not a
whole JPEG (``check_jpeg``), one the decoder fails on (``decode_guarded``),
a class index outside ``[0, num_classes)`` (``check_label``). JPEG files
that libjpeg decodes with only a warning (e.g. "premature end of data
segment", the missing part filled grey) are accepted, as by every
decoder-based pipeline.
"""
from __future__ import annotations

import seqio
import tensorflow as tf

from hypermixer_jax.data import config as data_config
from hypermixer_jax.data import preprocessors as prep
from hypermixer_jax.data import sources

MEAN_RGB = (0.485, 0.456, 0.406)
STDDEV_RGB = (0.229, 0.224, 0.225)
NORMALIZATIONS = data_config.IMAGE_NORMALIZATIONS


def random_resized_crop(image_bytes: tf.Tensor, seed: tf.Tensor, size: int,
                        min_area: float) -> tf.Tensor:
  """A random crop of the image, resized to size×size.

  The whole JPEG is decoded and then cropped (not ``decode_and_crop_jpeg``,
  which is faster but stops decoding at the crop's last row: a file corrupt
  further down would pass in training unnoticed, depending on the crop).
  """
  image = tf.io.decode_image(image_bytes, channels=3, expand_animations=False)
  shape = tf.shape(image)
  begin, crop_size, _ = tf.image.stateless_sample_distorted_bounding_box(
      shape, bounding_boxes=tf.constant([[[0.0, 0.0, 1.0, 1.0]]]), seed=seed,
      min_object_covered=0.0, aspect_ratio_range=(3 / 4, 4 / 3),
      area_range=(min_area, 1.0), max_attempts=10,
      use_image_if_no_bounding_boxes=True)
  image = tf.slice(image, begin, crop_size)
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


def normalize(image: tf.Tensor, method: str = "imagenet") -> tf.Tensor:
  """``[..., 3]`` pixels in [0, 255] normalised by ``method``
  (``NORMALIZATIONS``)."""
  image = tf.clip_by_value(image, 0.0, 255.0)
  if method == "inception":
    return (image - 127.5) / 127.5
  if method != "imagenet":
    raise ValueError(f"data.image_normalization={method!r}; choose from "
                     f"{NORMALIZATIONS}.")
  return (image / 255.0 - tf.constant(MEAN_RGB)) / tf.constant(STDDEV_RGB)


def to_patches(image: tf.Tensor, patch: int) -> tf.Tensor:
  """[..., H, W, C] -> [..., H/P * W/P, P*P*C], patches in row-major order."""
  h, w, c = image.shape[-3:]
  lead = tf.shape(image)[:-3]
  x = tf.reshape(image, tf.concat([lead, [h // patch, patch, w // patch,
                                          patch, c]], 0))
  rank = len(image.shape)
  outer = list(range(rank - 3))
  x = tf.transpose(x, outer + [rank - 3, rank - 1, rank - 2, rank, rank + 1])
  return tf.reshape(x, tf.concat([lead, [(h // patch) * (w // patch),
                                         patch * patch * c]], 0))


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


# Examples decoded together in one guarded group (see ``decode_guarded``).
DECODE_GROUP = 64


def decode_guarded(group: dict[str, tf.Tensor], image_fn, size: int
                   ) -> tf.Tensor:
  """``image_fn`` over a group of examples; a decoder failure names its file.

  libjpeg fails on a JPEG that is corrupt inside (valid SOI/EOI markers,
  garbage in between) with ``jpeg::Uncompress failed``, which names no file,
  and the error ends the whole tf.data iterator. Here the group's examples
  are decoded in a small nested dataset with ``ignore_errors``, their
  positions kept: a position missing from the output is a file the decoder
  refused, and a ``DataError`` names that example's ``source`` (TSV file,
  line and image path, or the TFDS record). Doing this per group rather than
  per example amortises the nested dataset's fixed cost: measured ~1-2 ms
  of CPU per group, i.e. 15-30 us an image, against 1.3-1.9 ms to decode a
  full-size ImageNet JPEG and ~40 us a 32x32 CIFAR one (one example per
  nested dataset cost ~50 ms an image).

  Args:
    group: batched features with ``image`` (bytes), ``source`` (string) and
      whatever ``image_fn`` reads.
    image_fn: one example's features -> ``[size, size, 3]`` float32.
    size: the output side.
  """
  n = tf.shape(group["source"], out_type=tf.int64)[0]
  decoded = (tf.data.Dataset.from_tensor_slices(group).enumerate()
             .map(tf.autograph.experimental.do_not_convert(
                 lambda i, ex: (i, image_fn(ex))))
             .ignore_errors()
             .batch(DECODE_GROUP * 4))
  empty = tf.data.Dataset.from_tensors((tf.zeros([0], tf.int64),
                                        tf.zeros([0, size, size, 3])))
  index, image = decoded.concatenate(empty).take(1).get_single_element()
  seen = tf.scatter_nd(index[:, None], tf.ones_like(index), [n])
  first_bad = tf.argmin(seen, output_type=tf.int64)  # 0 where all decoded
  check = sources.data_check(
      tf.equal(tf.size(index, out_type=tf.int64), n),
      tf.gather(group["source"], first_bad),
      ": the image decoder fails on this file (its SOI/EOI markers are "
      "intact, the data between them is corrupt); replace the file or drop "
      "its row.")
  with tf.control_dependencies([check]):
    return tf.identity(image)


def check_label(label: tf.Tensor, source: tf.Tensor | str, num_classes: int
                ) -> tf.Operation:
  """Refuses a class index outside ``[0, num_classes)``, naming its source."""
  return sources.data_check(
      (label >= 0) & (label < num_classes), source, ": class index ",
      label, f" is not in [0, {num_classes}) (data.num_classes="
      f"{num_classes}); fix the row, or set --config.data.num_classes and "
      "--config.model.num_classes to the data's number of classes.")


def preprocess(ds: tf.data.Dataset, *, train: bool, image_size: int,
               patch_size: int, min_crop_area: float, crop_fraction: float,
               num_classes: int, source_prefix: str = "",
               normalization: str = "imagenet",
               shard_index: int = 0) -> tf.data.Dataset:
  """{'image': JPEG bytes, 'label', 'source'} -> {'inputs': patches, 'label'}.

  ``source`` (the TSV file and line, or the TFDS record's file name, after
  ``source_prefix``) is what error messages quote: a file that is not a
  whole JPEG, one the decoder fails on, a class index outside
  ``[0, num_classes)``. ``normalization``: see ``NORMALIZATIONS``.
  ``shard_index``: the host's (``preprocessors.for_host``: each host draws
  its own crops and flips).
  """
  if normalization not in NORMALIZATIONS:
    raise ValueError(f"data.image_normalization={normalization!r}; choose "
                     f"from {NORMALIZATIONS}.")
  # The functions mapped here are plain graph code (no Python control flow
  # on tensors): autograph, whose conversion each pipeline build would redo
  # (0.4-0.7 s), is skipped.
  @seqio.map_over_dataset(num_seeds=1)
  @tf.autograph.experimental.do_not_convert
  def checked(ex, seed):
    seed = prep.for_host(seed, shard_index)
    source = tf.strings.join([source_prefix, ex["source"]])
    label = tf.cast(ex["label"], tf.int64)
    checks = [check_jpeg(ex["image"], source),
              check_label(label, source, num_classes)]
    with tf.control_dependencies(checks):
      return {"image": tf.identity(ex["image"]),
              "label": tf.cast(label, tf.int32), "source": source,
              "seed": seed}

  @tf.autograph.experimental.do_not_convert
  def image_fn(ex):
    if train:
      crop_seed, flip_seed = tf.unstack(
          tf.random.experimental.stateless_split(ex["seed"], 2))
      image = random_resized_crop(ex["image"], crop_seed, image_size,
                                  min_crop_area)
      image = tf.image.stateless_random_flip_left_right(image, flip_seed)
    else:
      image = resize_centre_crop(ex["image"], image_size, crop_fraction)
    image.set_shape([image_size, image_size, 3])
    return image

  @tf.autograph.experimental.do_not_convert
  def to_patches_batch(group):
    images = decode_guarded(group, image_fn, image_size)
    patches = to_patches(normalize(images, normalization), patch_size)
    return {"inputs": patches, "label": group["label"]}

  return (checked(ds).batch(DECODE_GROUP)
          .map(to_patches_batch, num_parallel_calls=tf.data.AUTOTUNE)
          .unbatch())

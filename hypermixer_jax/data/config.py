"""The data configuration (``config.data``): every field the pipelines read."""
from __future__ import annotations

import math
import os

import ml_collections
from ml_collections import config_dict

# seqio's (and T5's) default vocabulary. Many machines cannot reach the bucket:
# set HYPERMIXER_VOCAB, pass --config.data.vocab_path=/local/file.model, or
# train one with `python -m hypermixer_jax.data.train_vocab`.
T5_VOCAB_GCS = "gs://t5-data/vocabs/cc_all.32000/sentencepiece.model"


# Every split name a task may read (MNLI has matched/mismatched ones).
# ``data.image_normalization``: pixels in [0, 255] -> model inputs.
# ``imagenet``: per-channel mean/std of ImageNet; ``inception``: [-1, 1], what
# the official MLP-Mixer and ViT checkpoints were trained on.
IMAGE_NORMALIZATIONS = ("imagenet", "inception")
SPLITS = ("train", "validation", "test", "validation_matched",
          "validation_mismatched", "test_matched", "test_mismatched")


def local_files(cfg: ml_collections.ConfigDict) -> dict[str, str]:
  """``{split: pattern}`` of the ``data.local_files`` entries that are set."""
  return {k: v for k, v in (cfg.local_files or {}).items() if v}


def default_threadpool_size() -> int:
  """The host's cores available to this process, and at least 8.

  tf.data's shared pool has one thread per core, and parallel maps, the
  interleave of files and batching wait on each other in it; on few cores
  that starves them (SST-2 on 2 cores: 6.5-7.1k examples/s with the shared
  pool, 10.1-10.5k with a private pool of 8).
  """
  try:
    cores = len(os.sched_getaffinity(0))
  except AttributeError:  # not Linux
    cores = os.cpu_count() or 1
  return max(8, cores)


def default_data_config() -> ml_collections.ConfigDict:
  """Returns the data config with defaults for every field.

  Fields:
    task: one of ``hypermixer_jax.data.TASK_NAMES`` ('c4_mlm', 'c4_lm',
      'glue_sst2', 'glue_mnli', 'glue_qnli', 'glue_qqp', 'glue_snli',
      'imagenet_patches', 'synthetic_pairs').
    seq_len: tokens per row for the text tasks (128 and 512 in the papers).
    vocab_path: a SentencePiece ``.model`` file (local path or gs://).
    extra_ids: sentinel ids appended to the SentencePiece vocabulary by seqio
      (100 as in T5); the first three serve as [MASK], [CLS] and [SEP].
    data_dir: TFDS data directory (None: TFDS's default).
    tfds_train_split: the TFDS split expression read as ``train`` (e.g.
      ``train[:10%]`` for the low-resource experiments); '' = ``train``.
    tfds_validation_split: the TFDS split expression read as
      ``validation`` (e.g. ``train[:10%]``: a validation split carved from
      train for choosing hyperparameters, as ``selection.tfds_carve``);
      '' = the task's own validation split.
    local_files: one field per split (``train``, ``validation``, ``test``,
      and MNLI's ``validation_matched`` ...), each a file pattern
      (comma-separated patterns allowed) of local JSONL (.jsonl, flat
      objects), TSV with a header (.tsv) or text (.txt, .raw) files; when any
      is set, TFDS is not used. Set them one by one from the command line:
      ``--config.data.local_files.train=/data/SST-2/train.tsv``. For
      ImageNet: a ``filename<TAB>class_index`` TSV with image paths relative
      to it (or to its ``images/`` folder).
    text_layout: how local text files (.txt, .raw) of the text tasks
      divide into documents: 'lines' (each non-empty line is one) or
      'wikitext' (WikiText-2/103 ``wiki.*.raw``: one document per article,
      its paragraphs and section headings joined, blank lines and the
      ``= Heading =`` markup dropped, WikiText's tokenization such as
      ``@-@`` and spaces before punctuation undone; see
      ``wikitext.open_wikitext``). Documents are cut into ``seq_len`` rows.
    allow_empty_inputs: keep local rows whose input fields (all but the
      label) are empty; by default such a row stops the run naming its file
      and line (an empty sentence is rarely meant).
    packing: pack several short examples per row (segment ids mark them).
    shuffle_buffer_size: examples in the seeded shuffle buffer.
    threadpool_size: threads of the tf.data pipelines' private thread pool;
      0 = ``default_threadpool_size()`` (the host's cores, at least 8).
      Only speed depends on it: a checkpointed position restores under
      another size (docs/performance.md, Input pipelines, has the command
      that measures pipelines).
    mlm: BERT masking rates (selection, [MASK], random token).
    image_size, patch_size: resolution and square patch side for ImageNet.
    min_crop_area: smallest area fraction of the random resized crop.
    image_normalization: ``imagenet`` (per-channel mean/std) or
      ``inception`` ((x - 127.5) / 127.5, the official MLP-Mixer/ViT
      checkpoints' inputs; recorded by ``models.official_mixer``).
    crop_fraction: eval centre crop fraction (image_size / resized side);
      1.0 keeps the whole image (CIFAR).
    num_classes: classes of the image task (1000 for ImageNet-1k, 10 for
      CIFAR-10); a class index outside ``[0, num_classes)`` stops the
      pipeline at its row, and ``check_fits_model`` requires
      ``model.num_classes >= num_classes`` at start.
    synthetic: options of the §4.7 shape-pairs task (see ``synthetic.py``).
  """
  c = ml_collections.ConfigDict()
  c.task = "synthetic_pairs"
  c.seq_len = 128
  c.vocab_path = os.environ.get("HYPERMIXER_VOCAB", T5_VOCAB_GCS)
  c.extra_ids = 100
  c.data_dir = config_dict.placeholder(str)
  c.tfds_train_split = ""
  c.tfds_validation_split = ""
  c.local_files = ml_collections.ConfigDict(
      {split: config_dict.placeholder(str) for split in SPLITS})
  c.text_layout = "lines"
  c.allow_empty_inputs = False
  c.packing = False
  c.shuffle_buffer_size = 10_000
  c.threadpool_size = 0

  c.mlm = ml_collections.ConfigDict()
  c.mlm.select_rate = 0.15
  c.mlm.mask_token_rate = 0.8
  c.mlm.random_token_rate = 0.1

  c.image_size = 224
  c.patch_size = 16
  c.min_crop_area = 0.08
  c.crop_fraction = 0.875
  c.image_normalization = "imagenet"
  c.num_classes = 1000

  c.synthetic = ml_collections.ConfigDict()
  c.synthetic.seq_len = 64
  c.synthetic.data_seed = 0                # the data set; the pipeline seed only orders it
  c.synthetic.num_examples = 50_000       # train split; 0 = endless fresh examples
  c.synthetic.num_eval_examples = 2_000   # validation and test splits
  c.synthetic.validation_every = 0         # k > 0: validation = every k-th train sequence
  c.synthetic.shapes = ("triangle", "box")
  c.synthetic.min_height = 1.0
  c.synthetic.max_height = 25.0
  c.synthetic.min_width = 3
  c.synthetic.max_width = 9
  c.synthetic.noise = 0.3                  # uniform input noise, in height units
  c.synthetic.normalize = True             # divide heights by max_height
  return c


def max_predictions(seq_len: int, select_rate: float = 0.15) -> int:
  """BERT's ``max_predictions_per_seq`` for rows of ``seq_len`` tokens.

  ``ceil(select_rate * seq_len)`` (20 for 128 at 15%, BERT's own value).
  ``bert_mask`` selects ``max(1, round(select_rate * n))`` tokens of an
  ``n``-token example, never more than this for ``n <= seq_len``, so an
  unpacked row always fits; a packed row keeps its first ones
  (``converters.MLMFeatureConverter``).
  """
  # The tolerance keeps a product just above an integer (0.07 * 100 =
  # 7.000000000000001) at that integer.
  return max(1, math.ceil(select_rate * seq_len - 1e-9))

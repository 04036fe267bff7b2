"""The README's CPU-sized pretrain -> fine-tune -> evaluate recipe, run with
its own commands at toy size (later flags override earlier ones), and a
fine-tune whose model fields differ from its checkpoint's."""
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRETRAIN, FINETUNE = "/tmp/mlm_tiny", "/tmp/sst2_tiny"
# The recipe as the README gives it ($DATA: the shared data samples).
RECIPE = [
    ["--config=configs/c4_mlm.py:hypermixer", f"--workdir={PRETRAIN}",
     "--config.data.vocab_path=$DATA/t5_spm/sentencepiece.model",
     "--config.data.local_files.train=$DATA/c4/c4_en_train_00000_first1000.jsonl",
     "--config.data.local_files.validation="
     "$DATA/c4/c4_en_tfds_minimal_validation_200.jsonl",
     "--config.data.seq_len=64", "--config.model.max_len=64",
     "--config.model.num_layers=2", "--config.model.d_model=64",
     "--config.model.d_ffn=128", "--config.model.mixer_kwargs.hyper_dim=32",
     "--config.batch_size=16", "--config.num_train_steps=200",
     "--config.warmup_steps=20", "--config.learning_rate=1e-3",
     "--config.eval_every=200", "--config.eval_steps=4",
     "--config.eval_batch_size=32", "--config.log_every=50",
     "--config.checkpoint_every=200"],
    ["--config=configs/glue.py:sst2,hypermixer,finetune",
     f"--workdir={FINETUNE}", f"--config.init_checkpoint={PRETRAIN}",
     "--config.data.vocab_path=$DATA/t5_spm/sentencepiece.model",
     "--config.data.local_files.train=$DATA/glue/SST-2/train.tsv",
     "--config.data.local_files.validation=$DATA/glue/SST-2/dev.tsv",
     "--config.data.seq_len=64", "--config.batch_size=32",
     "--config.num_train_steps=300", "--config.warmup_steps=30",
     "--config.learning_rate=1e-3", "--config.eval_every=300",
     "--config.log_every=100", "--config.checkpoint_every=300"],
    ["--mode=evaluate", f"--workdir={FINETUNE}"],
]
# Toy sizes; the shuffle buffers fill from a few examples (the default,
# 10,000, tokenizes much of a sample file before the first batch), and the
# evaluation scores a few batches.
TOY = [
    ["--config.data.seq_len=32", "--config.model.max_len=32",
     "--config.model.num_layers=1", "--config.model.d_model=16",
     "--config.model.d_ffn=32", "--config.model.mixer_kwargs.hyper_dim=8",
     "--config.batch_size=8", "--config.num_train_steps=4",
     "--config.warmup_steps=1", "--config.eval_every=4",
     "--config.eval_steps=1", "--config.eval_batch_size=8",
     "--config.log_every=2", "--config.checkpoint_every=4",
     "--config.data.shuffle_buffer_size=64"],
    ["--config.data.seq_len=32", "--config.batch_size=8",
     "--config.num_train_steps=4", "--config.warmup_steps=1",
     "--config.eval_every=4", "--config.eval_steps=2",
     "--config.eval_batch_size=16", "--config.log_every=2",
     "--config.checkpoint_every=4", "--config.data.shuffle_buffer_size=64"],
    ["--eval_steps=2"],   # 2 batches, not the whole dev set
]


def _readme_commands() -> list[list[str]]:
  """The flags of the README's ``hypermixer_jax.main`` commands on the
  recipe's workdirs (continuation lines joined, ``$DATA`` kept)."""
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    text = f.read().replace("\\\n", " ")
  out = []
  for line in text.splitlines():
    if PRETRAIN not in line and FINETUNE not in line:
      continue
    try:
      words = shlex.split(line.split("#", 1)[0])
    except ValueError:   # prose with an apostrophe
      continue
    if "hypermixer_jax.main" in words:
      out.append(words[words.index("hypermixer_jax.main") + 1:])
  return out


def _run(flags, data, tmp_path, cwd=ROOT):
  """The command from ``cwd``, with ``$DATA`` a path relative to the
  repository (a user's relative paths)."""
  data = os.path.relpath(os.path.realpath(data), os.path.realpath(ROOT))
  flags = [f.replace("$DATA", str(data)).replace(PRETRAIN, str(
      tmp_path / "mlm_tiny")).replace(FINETUNE, str(tmp_path / "sst2_tiny"))
           for f in flags]
  env = dict(os.environ, PYTHONPATH=ROOT,
             XLA_FLAGS=os.environ["HYPERMIXER_TEST_XLA_FLAGS"])
  return subprocess.run([sys.executable, "-m", "hypermixer_jax.main", *flags],
                        cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=600)


def test_readme_gives_the_recipe():
  assert _readme_commands() == RECIPE


@pytest.mark.slow
def test_recipe_runs_and_fine_tuning_takes_the_checkpoints_shapes(
    shared_data, tmp_path):
  pre = _run(RECIPE[0] + TOY[0], shared_data, tmp_path)
  assert pre.returncode == 0, pre.stderr[-3000:]
  # A model field set on the command line against the checkpoint: one line
  # naming the config field, before anything is built.
  clash = _run(RECIPE[1] + TOY[1] + ["--config.model.d_ffn=64"], shared_data,
               tmp_path)
  assert clash.returncode == 1
  assert clash.stderr.strip().splitlines()[-1] == (
      f"Stopped: init_checkpoint {tmp_path / 'mlm_tiny'} has other parameter "
      "shapes than this config (model.d_ffn: checkpoint 32, config 64); drop "
      "--config.model.d_ffn to take the checkpoint's values, or train from "
      "scratch without --config.init_checkpoint.")
  assert "shape mismatch" not in clash.stderr
  assert not (tmp_path / "sst2_tiny" / "checkpoints").exists()
  # Left at the config file's values, they come from the checkpoint.
  fine = _run(RECIPE[1] + TOY[1], shared_data, tmp_path)
  assert fine.returncode == 0, fine.stderr[-3000:]
  adopted = re.search(r"Model fields from init_checkpoint \S+ \(\S+\): (.*)",
                      fine.stderr)
  assert adopted and adopted[1] == (
      "model.d_ffn: 512 -> 32; model.d_model: 256 -> 16; "
      "model.mixer_kwargs.hyper_dim: 768 -> 8; model.num_layers: 6 -> 1")
  saved = json.loads((tmp_path / "sst2_tiny" / "config.json").read_text())
  assert (saved["model"]["d_ffn"], saved["model"]["head"]) == (32, "classify")
  # The relative data paths were saved absolute: the evaluation runs from
  # another folder and reads the same files.
  assert os.path.realpath(saved["data"]["local_files"]["validation"]) == (
      os.path.realpath(os.path.join(shared_data, "glue/SST-2/dev.tsv")))
  assert os.path.isabs(saved["data"]["local_files"]["validation"])
  ev = _run(RECIPE[2] + TOY[2], shared_data, tmp_path, cwd=tmp_path)
  assert ev.returncode == 0, ev.stderr[-3000:]
  record = json.loads(
      (tmp_path / "sst2_tiny" / "evaluations" / "validation_step4.json"
       ).read_text())
  assert record["step"] == 4 and 0.0 <= record["accuracy"] <= 1.0
  assert record["examples"] == 32

r"""Does masked-LM pretraining pay off? Pretrain, fine-tune, compare to scratch.

The HyperMixer paper trains its GLUE models from scratch only; the gMLP paper
(Liu et al. 2021, §4) pretrains and claims gMLP closes the gap to BERT on
fine-tuning. This experiment follows the user's path through the codebase:
a masked-LM run (``configs/c4_mlm.py``'s setting) leaves an Orbax checkpoint,
and the small GLUE classifier loads its encoder as ``configs/glue.py``'s
``finetune`` variant does (classifier re-initialised,
``init_reinit='(?!encoder/)'``; budget and learning rate are this study's),
against the same model trained from scratch with the same fine-tuning budget.

  --scale=small  the GLUE layout at width 128 (``experiment.glue
                 .small_model``: 2 layers, sequence length 64) on the 8k
                 SentencePiece vocabulary of ``mlm_perplexity`` (trained on
                 the C4 train sample; shared by pretraining and fine-tuning,
                 and by both arms); pretraining: MLM on both local C4 train
                 samples (2,000 documents), ``--pretrain_steps`` of batch 64,
                 held-out MLM perplexity on WikiText-2 validation beside the
                 unigram and bigram baselines of the same positions;
                 fine-tuning: SST-2 with ``--fractions`` of the 67,349 train
                 phrases (``experiment.glue.subset_tsv``), ``--finetune_steps``
                 of batch 64, both arms; each (model, arm, setting) takes
                 the best of ``--lrs`` x ``--warmup_shares`` by the final
                 accuracy of a seed-100 run on a validation split carved
                 from the setting's train file (``carve_setting``: whole
                 SST-2 sentences, whole pair-task premises; a pretrained
                 arm from a seed-100 pretraining), then every
                 seed runs there on the whole train file; seeds ``--seeds``
                 (pretraining and fine-tuning alike); Naive Bayes on the
                 same tokens beside them; the pair task (``--tasks``, SNLI):
                 the 80% train part of ``nli_splits``' fixed cut of its dev
                 file, tested on the 20% part, at length 64 (about 1% of
                 SNLI's pairs are longer), from the same encoders; a linear
                 probe (``hypermixer_jax.probe``) of each pretrained
                 encoder, frozen, against a fresh one, on each fraction's
                 SST-2 rows: what pretraining put into the features.

  python experiments/pretrain_finetune.py --scale=small \
      --out=experiments/results/pretrain_finetune

Two processes on one ``--out`` can split the work (``--arms``). Writes
``results.json``, ``table.md`` and ``pretrain_finetune.png`` into ``--out``.
At paper scale: configs/c4_mlm.py, then configs/glue.py:TASK,MIXER,finetune.
"""
from __future__ import annotations

import pathlib

from hypermixer_jax import experiment
from hypermixer_jax.experiment import glue
from hypermixer_jax.experiment import mlm
from hypermixer_jax.experiment import selection
# pylint: disable=g-importing-member
from hypermixer_jax.experiment.pretraining import ARMS
from hypermixer_jax.experiment.pretraining import carve_setting
from hypermixer_jax.experiment.pretraining import carved_search_run
from hypermixer_jax.experiment.pretraining import choose_carved
from hypermixer_jax.experiment.pretraining import finetune_config
from hypermixer_jax.experiment.pretraining import nb_key
from hypermixer_jax.experiment.pretraining import pretrain_config
from hypermixer_jax.experiment.pretraining import probe_encoders
from hypermixer_jax.experiment.pretraining import report
from hypermixer_jax.experiment.pretraining import retire_other_decay
from hypermixer_jax.experiment.pretraining import search_grid
from hypermixer_jax.experiment.pretraining import select_key
from hypermixer_jax.experiment.pretraining import selection_config
from hypermixer_jax.experiment.pretraining import settings_of
from hypermixer_jax.experiment.pretraining import SMALL
from hypermixer_jax.experiment.pretraining import WARMUP
from hypermixer_jax.experiment.pretraining import warmup_key
from hypermixer_jax.train import run_config

MODELS = ("hypermixer", "attention", "gmlp")
# SST-2 at --fractions of its labels, then a pair task at all of its own.
TASKS = ("sst2", "snli")


def _parser():
  p = experiment.parser("pretrain_finetune", __doc__, report_only=True,
                        models=MODELS, seeds="0,1,2")
  p.add_argument("--tasks", default=",".join(TASKS), help="sst2 and/or a "
                 "pair task of nli_splits (mnli, snli, qnli)")
  p.add_argument("--fractions", default=SMALL["fractions"],
                 help="fractions of SST-2's train phrases (a pair task "
                 "always uses its whole train part)")
  p.add_argument("--lrs", default=SMALL["lrs"], help="fine-tuning "
                 "learning rates searched on the carved validation split")
  p.add_argument("--warmup_shares", default=SMALL["warmup_shares"],
                 help="tried with each lr")
  p.add_argument("--pair_grid", default="", help="LRS/SHARES: the pair "
                 "task's own search (e.g. 3e-4,1e-3/0.1); default: --lrs x "
                 "--warmup_shares")
  p.add_argument("--arms", default=",".join(ARMS),
                 help="the arms this process trains (each arm chooses its "
                 "own learning rate, so two processes can take one each); "
                 "the other arm's recorded cells are still reported")
  p.add_argument("--pretrain_steps", type=int, default=SMALL["pretrain_steps"])
  p.add_argument("--finetune_steps", type=int, default=SMALL["finetune_steps"])
  return p


class _Grid:
  """The study's cells: pretraining, fine-tuning and probe runs, each
  recorded in ``exp`` (run only for the arms in ``trained``)."""

  def __init__(self, exp, args, shared, vocab, trained):
    self.exp, self.args, self.shared, self.vocab = exp, args, shared, vocab
    self.trained = trained
    self.tag = f"p{args.pretrain_steps}_f{args.finetune_steps}"
    self.sentences = glue.sentence_groups(glue.sst2_train(shared))

  def pretrain_key(self, mixer: str, seed: int) -> str:
    return f"pretrain/s{self.args.pretrain_steps}/model={mixer}/seed={seed}"

  def pretrain(self, mixer: str, seed: int) -> tuple[str, dict]:
    exp, key = self.exp, self.pretrain_key(mixer, seed)
    cfg = pretrain_config(mixer, self.shared, self.vocab, seed=seed,
                          steps=self.args.pretrain_steps)
    # The seed fixes the held-out masks.
    exp.baseline(f"mlm/seed={seed}", lambda: mlm.lm_baselines(cfg))
    return exp.workdir(key), exp.cell(key, lambda: experiment.train(
        cfg, exp.workdir(key)))

  def encoder(self, mixer: str, seed: int) -> tuple[str, dict]:
    """(workdir, {}); a run without its last step (not kept, cut short) is
    pretrained again or resumed: the dict has both held-out perplexities."""
    workdir, recorded = self.pretrain(mixer, seed)
    if run_config.checkpoint_steps(workdir)[-1:] == [self.args.pretrain_steps]:
      return workdir, {}
    again = experiment.train(pretrain_config(
        mixer, self.shared, self.vocab, seed=seed,
        steps=self.args.pretrain_steps), workdir)
    return workdir, {
        "pretrain_again_perplexity": again["eval"]["perplexity"],
        "pretrain_recorded_perplexity": recorded["eval"]["perplexity"]}

  def probe(self, mixer: str, fraction: float, seed: int) -> None:
    key = (f"probe/s{self.args.pretrain_steps}/model={mixer}/"
           f"fraction={fraction:g}/seed={seed}")

    def run():
      workdir, extra = self.encoder(mixer, seed)
      cfg = finetune_config(mixer, self.shared, self.vocab, lr=1.0, seed=seed,
                            fraction=fraction, out=self.exp.out, steps=1,
                            init=workdir)
      return dict(probe_encoders(cfg, workdir, seed), **extra)
    self.exp.cell(key, run)

  def finetune(self, mixer, task, fraction, arm, lr, seed, *,
               share: float = WARMUP) -> str:
    """The cell's key, after running it (when ``arm`` is one of
    ``--arms``; else only what is recorded counts)."""
    exp = self.exp
    # SST-2 cells keep keys without the task (the first recorded ones).
    cell = dict(model=mixer, fraction=fraction, arm=arm, lr=lr,
                **warmup_key(share), seed=seed)
    key = experiment.cell_key(
        self.tag, cell if task == "sst2" else dict(task=task, **cell))
    init = (exp.workdir(self.pretrain_key(mixer, seed))
            if arm == "pretrained" else "")
    cfg = self.config(mixer, task, fraction, lr, share, seed, init)
    exp.baseline(nb_key(task, fraction),
                 lambda: glue.bag_of_words_baselines(cfg))

    def run():
      extra = self.encoder(mixer, seed)[1] if init else {}
      return dict(experiment.train(cfg, exp.workdir(key)), **extra,
                  init=exp.runs.get(self.pretrain_key(mixer, seed),
                                    {}).get("eval"))
    if arm in self.trained:
      exp.cell(key, run)
    return key

  def config(self, mixer, task, fraction, lr, share, seed, init):
    return finetune_config(mixer, self.shared, self.vocab, lr=lr, seed=seed,
                           fraction=fraction, out=self.exp.out, init=init,
                           steps=self.args.finetune_steps, task=task,
                           warmup=share)

  def select(self, mixer, task, fraction, arm, lr, share=WARMUP) -> str | None:
    """The key of the selection run of ``lr`` and warm-up ``share`` (seed
    ``selection.SEED``, carved split of the setting's train file), after
    running it when ``arm`` is trained here (``carved_search_run``)."""
    exp, seed = self.exp, selection.SEED
    key = select_key(self.tag, mixer, task, fraction, arm, lr, share)
    init = (exp.workdir(self.pretrain_key(mixer, seed))
            if arm == "pretrained" else "")
    cfg = self.config(mixer, task, fraction, lr, share, seed, init)
    split = carve_setting(cfg, exp.out, task, self.sentences)
    cfg = selection_config(cfg, split)

    def run():   # a run stopped on NaN/Inf: recorded, never chosen
      extra = self.encoder(mixer, seed)[1] if init else {}
      return dict(selection.or_diverged(lambda: dict(selection.lean(
          experiment.train(cfg, exp.workdir(key))), **extra)),
                  split=selection.split_record(split))
    return carved_search_run(exp, key, split, run, arm in self.trained)

  def setting(self, mixer, setting, grid, seeds, chosen, keys) -> None:
    """Each arm's (lr, warm-up share) of ``grid`` chosen on the carved
    validation split, then every seed at it. Until an arm's search is
    whole it has no choice and reports nothing ('searching'): never a rate
    picked on the reported score."""
    for arm in ARMS:
      search = {g: self.select(mixer, *setting, arm, *g) for g in grid}
      runs = self.exp.runs   # (as reloaded by the runs)
      if any(k is None or k not in runs for k in search.values()):
        chosen[mixer, setting, arm] = (None, WARMUP, "searching")
        keys[mixer, setting, arm] = []
        continue
      best = choose_carved(runs, search, grid)   # None: all diverged
      chosen[mixer, setting, arm] = (*(best or (None, WARMUP)),
                                     "validation" if best else "diverged")
      keys[mixer, setting, arm] = [
          self.finetune(mixer, *setting, arm, best[0], s, share=best[1])
          for s in seeds] if best else []


def main() -> None:
  args = experiment.parse(_parser())
  if args.scale != "small":
    raise SystemExit("pretrain_finetune: only --scale=small exists; at paper "
                     "scale run configs/c4_mlm.py, then configs/glue.py:"
                     "TASK,MIXER,finetune with --config.init_checkpoint.")
  exp = experiment.Experiment(args.out, args)
  shared = pathlib.Path(args.shared)
  vocab = mlm.c4_vocab(exp, shared)
  models, tasks = experiment.split(args.models), experiment.split(args.tasks)
  seeds = experiment.split(args.seeds, int)
  trained = experiment.split(args.arms)
  if not trained or set(trained) - set(ARMS):
    raise SystemExit(f"pretrain_finetune: --arms={args.arms!r}: give "
                     f"{' and/or '.join(ARMS)}, comma-separated.")
  cells = _Grid(exp, args, shared, vocab, trained)
  chosen, keys = {}, {}
  settings = settings_of(tasks, experiment.split(args.fractions, float))
  grids = {task: search_grid(args, task) for task in tasks}
  for mixer in models:
    retire_other_decay(exp, mixer, shared, vocab, tasks)   # they run again
    for setting in settings:
      cells.setting(mixer, setting, grids[setting[0]], seeds, chosen, keys)
    # Linear probes of the pretrained encoders (the SST-2 settings).
    for seed in (seeds if "pretrained" in trained else []):
      for fraction in (f for t, f in settings if t == "sst2"):
        cells.probe(mixer, fraction, seed)
  report(exp, args, models, settings, seeds, chosen, keys)


if __name__ == "__main__":
  main()

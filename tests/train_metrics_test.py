"""Observability: plain log lines, the progress bar's figures, MFU peaks."""
import io
import types

from absl import logging
import pytest

from hypermixer_jax.train import metrics as metrics_lib


def test_plain_log_line_per_log_step_without_terminal(capsys):
  bar = metrics_lib.ProgressBar(100, terminal=False)
  bar.update(20, {"loss": 0.421337, "steps_per_sec": 5.2, "mfu": 0.4312,
                  "learning_rate": 1e-3})
  bar.write("[m] step 20 eval: mse=0.1")
  bar.close()
  out = capsys.readouterr().out.splitlines()
  assert out == ["[train] step 20/100: loss=0.4213 steps/s=5.20 MFU=43.12% "
                 "learning_rate=0.001", "[m] step 20 eval: mse=0.1"]


def test_log_lines_go_to_absl_when_info_is_on(capsys):
  old = logging.get_verbosity()
  logging.set_verbosity(logging.INFO)
  records = []
  handler = types.SimpleNamespace()
  try:
    import logging as std  # pylint: disable=g-import-not-at-top

    class Keep(std.Handler):
      def emit(self, record):
        records.append(record.getMessage())

    handler = Keep()
    logging.get_absl_logger().addHandler(handler)
    metrics_lib.ProgressBar(10, terminal=False).update(5, {"loss": 1.0})
  finally:
    logging.get_absl_logger().removeHandler(handler)
    logging.set_verbosity(old)
  assert "[train] step 5/10: loss=1" in records
  assert capsys.readouterr().out == ""


def test_progress_bar_shows_this_steps_values(monkeypatch):
  """The bar drawn at a log step carries that step's loss (set_postfix must
  come before update, which redraws)."""
  stream = io.StringIO()
  import tqdm  # pylint: disable=g-import-not-at-top
  real = tqdm.tqdm
  monkeypatch.setattr(tqdm, "tqdm", lambda **kw: real(
      file=stream, mininterval=0, miniters=1, **kw))
  bar = metrics_lib.ProgressBar(10, terminal=True)
  bar.update(5, {"loss": 111.0})
  first = stream.getvalue()
  bar.update(10, {"loss": 222.0})
  second = stream.getvalue()[len(first):]
  bar.close()
  assert "loss=111" in first.split("\r")[-1]
  drawn = [s for s in second.split("\r") if "10/10" in s]
  assert drawn and all("loss=222" in s for s in drawn), second


@pytest.mark.parametrize("kind, peak", [
    ("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5e", 197e12),
    ("TPU v5", 459e12), ("TPU v5p", 459e12), ("TPU v6 lite", 918e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", 835e12), ("cpu", None)])
def test_peak_flops_by_device_kind(kind, peak):
  assert metrics_lib.peak_flops(kind) == peak
  assert metrics_lib.peak_flops(kind, 123e12) == 123e12   # config override


def test_mfu_uses_the_peak():
  t = metrics_lib.Throughput(8, 80, flops_per_step=2e12,
                             peak_flops_per_device=metrics_lib.peak_flops(
                                 "TPU v4"))
  t.start(0)
  t._t -= 2.0  # pylint: disable=protected-access  (2 s for 10 steps)
  out = t.update(10)
  assert out["steps_per_sec"] == pytest.approx(5.0, rel=1e-3)
  assert out["mfu"] == pytest.approx(5.0 * 2e12 / 275e12, rel=1e-3)
  dev = types.SimpleNamespace(device_kind="TPU v4")
  assert metrics_lib.device_peak_flops([dev, dev]) == 275e12
  assert metrics_lib.device_peak_flops([types.SimpleNamespace(
      device_kind="cpu")]) is None

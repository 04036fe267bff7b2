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


def _said(monkeypatch):
  lines = []
  monkeypatch.setattr(metrics_lib, "_say",
                      lambda text, warn=False: lines.append((text, warn)))
  return lines


def _wait_for(condition, timeout=20.0):
  import time  # pylint: disable=g-import-not-at-top
  end = time.monotonic() + timeout
  while not condition() and time.monotonic() < end:
    time.sleep(0.01)
  return condition()


@pytest.mark.parametrize("seconds, text", [
    (0.4, "0 s"), (59.6, "1 min 00 s"), (188, "3 min 08 s"),
    (3725, "1 h 02 min")])
def test_duration(seconds, text):
  assert metrics_lib.duration(seconds) == text


def test_heartbeat_speaks_while_the_caller_is_blocked(monkeypatch):
  lines = _said(monkeypatch)
  elapsed = []
  beat = metrics_lib.Heartbeat(
      lambda t: elapsed.append(t) or f"waiting {len(elapsed)}", every=0.05)
  # The main thread is blocked (as in XLA's compiler): lines still come,
  # each later than the one before.
  assert _wait_for(lambda: len(lines) >= 3)
  beat.stop()
  count = len(lines)
  assert lines[:2] == [("waiting 1", False), ("waiting 2", False)]
  assert elapsed[0] >= 0.05 and elapsed[1] > elapsed[0]
  import time  # pylint: disable=g-import-not-at-top
  time.sleep(0.2)
  assert len(lines) == count   # stopped means silent
  with pytest.raises(ValueError, match=r"Heartbeat\(every=0\) would repeat"):
    metrics_lib.Heartbeat(lambda t: "", every=0)


def test_announce_says_start_still_and_done(monkeypatch):
  lines = _said(monkeypatch)
  with metrics_lib.announce("compiling the train step", every=0.05):
    assert _wait_for(lambda: len(lines) >= 2)
  texts = [t for t, _ in lines]
  assert texts[0] == "compiling the train step ..."
  assert texts[1].startswith("still compiling the train step: ")
  assert texts[-1].startswith("compiling the train step: done in ")
  with metrics_lib.announce("quiet", enabled=False):
    pass
  assert [t for t, _ in lines] == texts


def test_first_line_warning_comes_once_and_only_in_silence(monkeypatch):
  lines = _said(monkeypatch)
  bar = metrics_lib.ProgressBar(10, terminal=False)
  bar.until_first_line(lambda t: "no log line yet", after=0.05)
  assert _wait_for(lambda: lines)
  import time  # pylint: disable=g-import-not-at-top
  time.sleep(0.2)
  assert lines == [("no log line yet", True)]   # once, as a warning
  # A line written before the deadline cancels it.
  bar.until_first_line(lambda t: "too late", after=1.0)
  bar.update(2, {"loss": 0.5})
  time.sleep(1.3)
  bar.close()
  assert [t for t, _ in lines] == ["no log line yet",
                                   "[train] step 2/10: loss=0.5"]

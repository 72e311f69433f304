"""``gyre run`` stops on Ctrl-C whatever SIGINT state it inherited, and its SIGUSR2 stack dump says how SIGINT is
handled. A non-interactive shell starts a background job (``make test > log &``) with SIGINT ignored, and the
driver it runs inherits that across ``exec``: Python then installs no ``KeyboardInterrupt`` handler, and the
driver went on supervising after the token-auth e2e test's Ctrl-C. A blocked SIGINT (the mask is inherited too)
never arrives at all. ``main(["run", ...])`` runs in this process with a stand-in for the controller's ``run``;
the process's SIGINT / SIGUSR2 state is put back afterwards."""

import faulthandler
import os
import signal
import time
from types import SimpleNamespace

import pytest

from gyre.services.cli import main as cli
from gyre.services.control.orchestration import controller

SLEEP_S = 2.0
"""How long the stand-in driver loop waits for the SIGINT it sent itself to stop it."""


@pytest.fixture
def signal_state():
    """Put back this process's SIGINT handler and mask and its SIGUSR2 handling after the test; a SIGINT still
    pending (blocked) is discarded first, so it cannot interrupt the test run."""
    sigint, sigusr2 = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGUSR2)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    yield
    faulthandler.unregister(signal.SIGUSR2)
    signal.signal(signal.SIGUSR2, sigusr2)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a pending SIGINT is dropped here
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    signal.signal(signal.SIGINT, sigint)


def _run_driver(monkeypatch, tmp_path, loop) -> int:
    """``main(["run", RECIPE])`` with the recipe, the machine check and the controller's ``run`` stood in for;
    ``loop()`` is the driver's supervision."""
    monkeypatch.setattr(cli, "load_recipe", lambda *a, **kw: SimpleNamespace(out_dir=tmp_path))
    monkeypatch.setattr(cli, "check_machine", lambda recipe: None)

    def run(recipe, console):
        loop()
        return {"wall_time_s": 0.0}

    monkeypatch.setattr(controller, "run", run)
    return cli.main(["run", "recipe.yaml"])


def _ctrl_c_then_supervise():
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, as the e2e test sends it
    time.sleep(SLEEP_S)  # _supervise_training's poll


@pytest.mark.parametrize("inherited", ["ignored", "blocked"])
def test_ctrl_c_stops_a_driver_that_inherited_sigint_ignored_or_blocked(inherited, signal_state, monkeypatch,
                                                                        tmp_path):
    if inherited == "ignored":  # what `cmd &` in a non-interactive shell hands down
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    else:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        _run_driver(monkeypatch, tmp_path, _ctrl_c_then_supervise)
    assert time.monotonic() - t0 < SLEEP_S, "the SIGINT was noticed only after the loop's sleep"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigusr2_dumps_the_stacks_and_the_sigint_handling(signal_state, monkeypatch, tmp_path, capfd):
    def loop():
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.2)  # the chained Python handler runs here, in the main thread

    assert _run_driver(monkeypatch, tmp_path, loop) == 0
    err = capfd.readouterr().err
    assert "in loop" in err and "Current thread" in err, err  # faulthandler's dump, all threads
    assert "SIGINT handler: <built-in function default_int_handler>; SigPnd=" in err, err
    assert "SigIgn=" in err and "SigBlk=" in err, err

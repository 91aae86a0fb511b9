"""The stop button never tears a frame: SIGINT is noted or held back, then delivered."""

import signal

import pytest


@pytest.fixture(autouse=True)
def default_sigint_handler():
    """Python's own SIGINT handler during each test, as in a kernel: a process started in the
    background of a non-interactive shell inherits SIGINT ignored, and Python then keeps it so."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_sigint_is_held_back_until_the_block_ends():
    import os
    import signal
    import threading

    from fsdp2nb.host.sigint import sigint_deferred

    reached_end_of_block = False
    with pytest.raises(KeyboardInterrupt):
        with sigint_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            # Sent from another thread too, as a kernel with helper threads may receive it.
            sender = threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGINT))
            sender.start()
            sender.join()
            reached_end_of_block = True
    assert reached_end_of_block
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler



def test_a_failing_block_keeps_its_own_error():
    import os
    import signal

    from fsdp2nb.host.sigint import sigint_deferred

    with pytest.raises(ValueError, match="the block's own error"):
        with sigint_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            raise ValueError("the block's own error")



def test_sigint_only_takes_note_inside_a_noted_block_and_nested_blocks_share_it():
    import os
    import signal

    from fsdp2nb.host.sigint import sigint_deferred, sigint_noted

    with sigint_noted() as notes:
        assert not notes.take()
        with sigint_deferred():  # inside: the press stays noted for the outer block's owner
            os.kill(os.getpid(), signal.SIGINT)
        assert notes.take()
        assert not notes.take()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler



def test_a_gate_handler_holds_sigint_without_swapping_handlers():
    import os
    import signal

    from fsdp2nb.host.sigint import SigintGate, sigint_deferred

    delivered = []
    gate = SigintGate(lambda signum, frame: delivered.append(signum))
    previous = signal.signal(signal.SIGINT, gate)
    try:
        with sigint_deferred():
            with sigint_deferred():
                os.kill(os.getpid(), signal.SIGINT)
            assert delivered == []  # still inside the outer block
            assert signal.getsignal(signal.SIGINT) is gate
        assert delivered == [signal.SIGINT]
        with pytest.raises(ValueError):
            with sigint_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                raise ValueError("the block failed")
        assert delivered == [signal.SIGINT]  # a block that raised drops the press
        os.kill(os.getpid(), signal.SIGINT)
        assert delivered == [signal.SIGINT, signal.SIGINT]  # outside any block: at once
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_press_just_after_an_interrupted_cell_is_dropped_and_a_later_one_acts():
    import os
    import signal
    import time

    from fsdp2nb.host.sigint import drop_late_presses

    signal.signal(signal.SIGINT, signal.default_int_handler)
    drop_late_presses(seconds=0.3)
    os.kill(os.getpid(), signal.SIGINT)  # the second half of a double press: dropped
    time.sleep(0.4)
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)  # a press of its own, later: acts as before
        time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_drop_asked_for_inside_a_noted_block_starts_where_the_block_ends():
    import os
    import signal
    import time

    from fsdp2nb.host.sigint import drop_late_presses, sigint_noted

    signal.signal(signal.SIGINT, signal.default_int_handler)
    with sigint_noted() as notes:
        os.kill(os.getpid(), signal.SIGINT)
        assert notes.take()
        drop_late_presses(seconds=0.3)
    os.kill(os.getpid(), signal.SIGINT)  # just after the block: dropped, no gap between the two
    time.sleep(0.4)
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

"""Lines redrawn with `\\r` (progress bars) shown as one display per rank, updated in place."""

import functools

from fsdp2nb.frontend.line_updates import (
    MIN_UPDATE_INTERVAL_S,
    SHOW_AFTER_S,
    LiveLines,
    counted_chars,
    visible,
)
from fsdp2nb.frontend.output import PARTIAL_LINE_WINDOW_S, StreamMerger


class FakeDisplays:
    """What the notebook would show: each display's current text, in the order they appeared."""

    def __init__(self):
        self.texts: list[str] = []
        self.num_updates = 0

    def show(self, text):
        index = len(self.texts)
        self.texts.append(text)
        displays = self

        class Handle:
            def update(self, obj, *, raw=False):
                assert raw
                displays.texts[index] = obj["text/plain"]
                displays.num_updates += 1

        return Handle()


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _merger(can_update=True, ranks=(0, 1)):
    written, displays, clock = [], FakeDisplays(), Clock()
    live = functools.partial(LiveLines, show=displays.show, can_update=lambda: can_update, clock=clock)
    merger = StreamMerger(ranks, len(ranks), lambda stream, text: written.append((stream, text)), live_lines=live)
    return merger, written, displays, clock


def _bar(percent):
    return f"\r{percent:3d}%|{'#' * (percent // 10):<10}| {percent // 10}/10"


def test_visible_is_what_a_terminal_shows():
    assert visible("plain") == "plain"
    assert visible("\r 10%|#  |\r 20%|## |") == " 20%|## |"
    assert visible("long text\rshort") == "shorttext"
    assert visible("\r 50%|#####|     \r") == " 50%|#####|"
    assert counted_chars("\r 10%\r 20%\r 30%\n") == len(" 30%\n")


def test_a_bar_becomes_one_display_per_rank_updated_in_place_and_left_final():
    merger, written, displays, clock = _merger()
    merger.feed(0, "stderr", "before\n", now=0.0)
    merger.feed(1, "stderr", "before\n", now=0.0)
    for rank in (0, 1):
        merger.feed(rank, "stderr", _bar(0), now=0.0)
    merger.poll(now=PARTIAL_LINE_WINDOW_S + 0.1)
    assert written == [("stderr", "[all] before\n")]
    assert displays.texts == ["[0]   0%|          | 0/10", "[1]   0%|          | 0/10"]
    for percent in range(10, 101, 10):
        clock.now += MIN_UPDATE_INTERVAL_S + 0.01
        for rank in (0, 1):
            merger.feed(rank, "stderr", _bar(percent), now=clock.now)
        merger.poll(now=clock.now)
    assert displays.texts[0].startswith("[0] 100%")
    merger.feed(0, "stderr", "\n", now=clock.now)
    merger.feed(1, "stderr", _bar(100) + " done\n", now=clock.now)
    merger.feed(0, "stdout", "after\n", now=clock.now)
    merger.feed(1, "stdout", "after\n", now=clock.now)
    merger.rank_done(0)
    merger.rank_done(1)
    merger.flush()
    assert displays.texts == ["[0] 100%|##########| 10/10", "[1] 100%|##########| 10/10 done"]
    assert written == [("stderr", "[all] before\n"), ("stdout", "[all] after\n")]


def test_a_redrawn_line_is_shown_at_its_second_drawing_where_plain_text_still_waits():
    """Text streamed for a fraction of a second is seen to grow; a partial line of plain text is
    still held for the merge window, in case every rank prints the same."""
    merger, written, displays, clock = _merger()
    merger.feed(0, "stdout", "\r[0] The light", now=0.0)
    merger.feed(1, "stdout", "no newline yet", now=0.0)
    clock.now = SHOW_AFTER_S
    merger.feed(0, "stdout", "\r[0] The light is", now=clock.now)
    merger.poll(now=clock.now)
    assert displays.texts == ["[0] [0] The light is"] and written == []
    merger.feed(0, "stdout", "\r[0] The light is on\n", now=clock.now)
    assert displays.texts == ["[0] [0] The light is on"] and written == []


def test_a_bar_that_ends_before_it_is_shown_is_one_clean_line():
    merger, written, displays, _ = _merger()
    for rank in (0, 1):
        merger.feed(rank, "stderr", "".join(_bar(p) for p in range(0, 101, 10)) + "\n", now=0.0)
    merger.flush()
    assert displays.texts == []
    assert written == [("stderr", "[all] 100%|##########| 10/10\n")]


def test_without_display_updates_only_the_final_state_is_written():
    merger, written, displays, _ = _merger(can_update=False)
    merger.feed(0, "stdout", _bar(10), now=0.0)
    merger.poll(now=PARTIAL_LINE_WINDOW_S * 3)
    merger.feed(0, "stdout", _bar(60), now=1.0)
    merger.poll(now=PARTIAL_LINE_WINDOW_S * 6)
    assert written == [] and displays.texts == []
    merger.feed(0, "stdout", _bar(100) + "\n", now=2.0)
    merger.flush()
    assert written == [("stdout", "[0] 100%|##########| 10/10\n")]


def test_a_bar_left_open_at_the_end_of_the_cell_shows_its_last_state():
    merger, written, displays, clock = _merger()
    merger.feed(1, "stderr", _bar(30), now=0.0)
    merger.poll(now=1.0)
    clock.now = 1.0
    merger.feed(1, "stderr", _bar(40), now=1.0)
    merger.rank_done(0)
    merger.rank_done(1)
    merger.flush()
    assert displays.texts == ["[1]  40%|####      | 4/10"] and written == []

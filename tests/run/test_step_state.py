"""The micro-steps' shared state (pure logic): groups, partial groups, the no-sync context."""

import contextlib

from paratrain.run.accumulation import StepState


class Loader:
    def __init__(self, length, seen):
        self.length, self.batches_in_epoch = length, seen

    def __len__(self):
        return self.length


def test_a_group_closes_after_accumulate_micro_steps_or_at_the_epochs_end():
    state = StepState(accumulate=3)
    assert [state.advance(None) for _ in range(3)] == [False, False, True]
    state.group_done()
    assert state.micro_step == 0 and not state.backward_seen
    # The epoch's last batch closes a partial group.
    assert state.at_boundary(Loader(length=5, seen=5)) and not state.at_boundary(Loader(5, 4))


def test_backward_and_counts_belong_to_the_group_and_abandon_reports_a_partial_one():
    state = StepState(accumulate=2)
    state.saw_backward(3)
    assert state.backward_seen and state.counts.active
    state.advance(None)
    assert state.abandon() is True and not state.counts.active and state.micro_step == 0
    assert state.abandon() is False


def test_the_no_sync_context_opens_once_and_closes_after_backward():
    events = []

    @contextlib.contextmanager
    def no_sync():
        events.append("enter")
        yield
        events.append("exit")

    state = StepState(accumulate=2)
    state.open_no_sync(no_sync())
    assert state.no_sync_open and events == ["enter"]
    state.close_no_sync()
    state.close_no_sync()  # a second close is a no-op
    assert not state.no_sync_open and events == ["enter", "exit"]

"""A room's faults are drawn once, as one object: which rooms get which fault, and the
delay's default, exactly as the fault specs say."""

from __future__ import annotations

from pdctl.serve.faults import Faults, RoomFaults


def test_no_faults_draws_nothing() -> None:
    none = Faults([])
    assert RoomFaults.for_prefill(9.0, none) == RoomFaults()
    assert RoomFaults.for_decode(none) == RoomFaults()
    assert RoomFaults() == RoomFaults(corrupt_kv=False, delay_s=None, drop_first_scatter=False)


def test_prefill_draws_corruption_and_delay_per_room() -> None:
    source = Faults(
        [
            {"name": "corrupt-kv", "every": 2},
            {"name": "delay-transfer", "spare": 1},  # no seconds: held past decode's timeout
        ]
    )
    rooms = [RoomFaults.for_prefill(8.0, source) for _ in range(4)]
    assert [r.corrupt_kv for r in rooms] == [False, True, False, True]
    assert [r.delay_s for r in rooms] == [None, 8.0, 8.0, 8.0]  # the first room is spared
    assert not any(r.drop_first_scatter for r in rooms)  # a decode fault, not prefill's


def test_a_delay_with_seconds_holds_that_long() -> None:
    source = Faults([{"name": "delay-transfer", "seconds": 1.5}])
    assert RoomFaults.for_prefill(8.0, source).delay_s == 1.5


def test_decode_draws_the_dropped_scatter_per_room() -> None:
    source = Faults([{"name": "drop-scatter", "every": 3}, {"name": "corrupt-kv"}])
    rooms = [RoomFaults.for_decode(source) for _ in range(6)]
    assert [r.drop_first_scatter for r in rooms] == [False, False, True, False, False, True]
    assert not any(r.corrupt_kv or r.delay_s is not None for r in rooms)


def test_abort_transfer_picks_the_same_rooms_on_both_sides() -> None:
    """By id: past the first `spare` + `after` rooms, those whose id is a multiple of
    `every`; each room counts once however often it is asked about, so prefill (which
    may draw a room's faults more than once) and decode agree."""
    spec = {"name": "abort-transfer", "every": 3, "after": 2, "spare": 1}
    prefill, decode = Faults([spec]), Faults([{**spec, "seconds": 0.25}])
    rooms = [9, 12, 30, 31, 33, 34, 36]  # the first three are spared
    picked = [r for r in rooms if decode.aborts(r) is not None]
    assert picked == [33, 36]
    late = [RoomFaults.for_prefill(8.0, prefill, room=r).late_write_s for r in rooms + rooms]
    assert late == [None, None, None, None, 0.1, None, 0.1] * 2  # default: 0.1 s
    assert RoomFaults.for_prefill(8.0, decode, room=33).late_write_s == 0.25
    assert RoomFaults.for_prefill(8.0, prefill) == RoomFaults()  # no room: no pick
    assert Faults([]).aborts(33) is None

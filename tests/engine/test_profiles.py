"""Profiles and the safe-mode trigger, without torch: a fake clock, exact switches."""

from __future__ import annotations

import json

import pytest

from pagewarden.engine.profiles import (
    NORMAL,
    SAFE,
    Profile,
    ProfileController,
    ProfileError,
    ProfileSettings,
    SafeModePolicy,
    load_profiles_file,
    parse_profiles,
    resolve,
    with_builtins,
)

BASE = ProfileSettings(
    integrity="standard",
    max_num_seqs=32,
    preemption_mode="swap",
    scrub_blocks_per_step=4,
    audit_interval=64,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _controller(**policy) -> tuple[ProfileController, Clock]:
    clock = Clock()
    names = (NORMAL, SAFE, "cautious")
    return ProfileController(names, SafeModePolicy(**policy), NORMAL, clock), clock


def test_k_faults_within_the_window_switch_to_safe() -> None:
    ctl, clock = _controller(faults=3, window_s=10.0, clean_period_s=30.0)
    assert ctl.observe(faults=1) is None
    clock.t += 11  # the first fault leaves the window
    assert ctl.observe(faults=1) is None
    clock.t += 5
    assert ctl.observe(faults=1) is None  # two within 10 s
    clock.t += 1
    switch = ctl.observe(faults=1)
    assert switch is not None
    assert (switch.old, switch.new, switch.reason) == (NORMAL, SAFE, "fault_burst")
    assert switch.detail == "3 faults within 10 s"
    assert ctl.state().switches == {(NORMAL, SAFE, "fault_burst"): 1}


@pytest.mark.parametrize(
    "kw,reason",
    [
        (dict(unrecoverable=1), "unrecoverable_fault"),
        (dict(audit_failures=2), "invariant_violation"),
    ],
)
def test_one_unrecoverable_fault_or_failed_audit_is_enough(kw, reason) -> None:
    ctl, _ = _controller()
    switch = ctl.observe(**kw)
    assert switch is not None and switch.reason == reason and ctl.active == SAFE


def test_safe_mode_ends_after_a_clean_period_and_each_fault_restarts_it() -> None:
    ctl, clock = _controller(faults=1, clean_period_s=30.0)
    ctl.observe(faults=1)
    assert ctl.active == SAFE
    clock.t += 29
    assert not ctl.due() and ctl.observe() is None
    assert ctl.observe(faults=1) is None  # still in safe; the clean period restarts
    clock.t += 29
    assert ctl.observe() is None
    clock.t += 1
    assert ctl.due()
    switch = ctl.observe()
    assert switch is not None
    assert (switch.old, switch.new, switch.reason) == (SAFE, NORMAL, "clean_period")
    assert ctl.active == NORMAL and not ctl.due()


def test_automatic_safe_mode_returns_to_the_profile_it_left() -> None:
    ctl, clock = _controller(faults=1, clean_period_s=5.0)
    ctl.request("cautious")
    ctl.observe(faults=1)
    assert ctl.active == SAFE
    clock.t += 5
    switch = ctl.observe()
    assert switch is not None and switch.new == "cautious"


def test_an_operator_choice_stays_and_auto_off_never_switches() -> None:
    ctl, clock = _controller(faults=1, clean_period_s=1.0)
    switch = ctl.request(SAFE)
    assert switch is not None and switch.reason == "operator"
    clock.t += 100
    assert not ctl.due() and ctl.observe() is None and ctl.active == SAFE
    assert ctl.request(SAFE) is None  # already there
    with pytest.raises(ProfileError, match="unknown profile 'fast'"):
        ctl.request("fast")
    off, _ = _controller(faults=1, auto=False)
    assert off.observe(faults=5, unrecoverable=1) is None and off.active == NORMAL


def test_safe_resolves_to_strict_floor_recompute_and_a_faster_scrubber() -> None:
    profiles = with_builtins(BASE, {})
    safe = resolve(profiles[SAFE], BASE, floor=8, has_host_tier=True)
    assert safe == ProfileSettings("strict", 8, "recompute", 16, 8, "verified")
    assert resolve(profiles[NORMAL], BASE, floor=8, has_host_tier=True) == BASE


def test_a_level_the_engine_cannot_reach_at_runtime_is_refused() -> None:
    off = ProfileSettings("off", 32, "recompute", 4, 64)
    assert with_builtins(off, {})[SAFE].integrity is None  # built-in safe keeps "off"
    with pytest.raises(ProfileError, match="cannot be switched to from 'off'"):
        resolve(Profile("mine", integrity="strict"), off, 8, False)
    with pytest.raises(ProfileError, match="host tier"):
        resolve(Profile("mine", preemption_mode="swap"), off, 8, False)
    with pytest.raises(ProfileError, match="exceeds"):
        resolve(Profile("mine", max_num_seqs=64), off, 8, False)


def test_profiles_files_in_yaml_json_and_toml(tmp_path) -> None:
    (tmp_path / "p.yaml").write_text(
        "profiles:\n  safe:\n    integrity: strict\n    max_num_seqs: floor\n"
        "  cautious:\n    max_num_seqs: 16\n    scrub_blocks_per_step: 8\n"
    )
    data = {"profiles": {"cautious": {"max_num_seqs": 16, "scrub_blocks_per_step": 8}}}
    (tmp_path / "p.json").write_text(json.dumps(data))
    (tmp_path / "p.toml").write_text(
        "[profiles.cautious]\nmax_num_seqs = 16\nscrub_blocks_per_step = 8\n"
    )
    cautious = Profile("cautious", max_num_seqs=16, scrub_blocks_per_step=8)
    from_yaml = load_profiles_file(tmp_path / "p.yaml")
    assert from_yaml == {SAFE: Profile(SAFE, "strict", "floor"), "cautious": cautious}
    assert load_profiles_file(tmp_path / "p.json") == {"cautious": cautious}
    assert load_profiles_file(tmp_path / "p.toml") == {"cautious": cautious}
    # A redefined safe replaces the built-in one whole.
    assert with_builtins(BASE, from_yaml)[SAFE] == Profile(SAFE, "strict", "floor")


@pytest.mark.parametrize(
    "data,match",
    [
        ({"cautious": {}}, "one top-level key"),
        ({"profiles": {"normal": {}}}, "configured engine"),
        ({"profiles": {"x": {"max_batch": 3}}}, "unknown settings"),
        ({"profiles": {"x": {"integrity": "paranoid"}}}, "integrity must be"),
        ({"profiles": {"x": {"max_num_seqs": 0}}}, "positive integer or 'floor'"),
        ({"profiles": {"x": {"prefix_cache": "none"}}}, "keep' or 'verified"),
    ],
)
def test_invalid_profiles_say_what_is_wrong(data, match) -> None:
    with pytest.raises(ProfileError, match=match):
        parse_profiles(data)

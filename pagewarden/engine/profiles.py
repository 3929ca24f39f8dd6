"""Engine profiles: named sets of engine settings, and when to switch between them.

A profile names the settings it changes from the configured engine; whatever it does not
name keeps the configured value. Two are built in:

- ``normal``: the engine as configured (it names nothing);
- ``safe``, the known stable state to roll back to: integrity ``strict``, the batch held
  at the adaptive controller's floor, recompute preemption (no swapping), the prefix
  cache's entries of blocks nobody holds dropped on entry (so reuse is limited to blocks
  sealed, and verified at seal, since the switch, or held and verified at every read),
  the scrubber at four times the configured rate, metadata audits every 8 steps.

Users add their own, or redefine ``safe``, in a profiles file (YAML, JSON or TOML)::

    profiles:
      safe:                      # replaces the built-in safe profile whole
        integrity: strict
        max_num_seqs: floor      # the adaptive batch controller's floor
        preemption_mode: recompute
        scrub_blocks_per_step: 32
        audit_interval: 8
        prefix_cache: verified   # keep | verified
      cautious:
        max_num_seqs: 32

``ProfileController`` decides the switches:

- to ``safe`` when ``faults`` detected faults fall within ``window_s`` seconds
  (``fault_burst``), on a fault no recovery could repair (``unrecoverable_fault``) or on a
  failed metadata audit (``invariant_violation``), unless automatic safe mode is off;
- back to the profile it left after ``clean_period_s`` seconds without a fault
  (``clean_period``), only when it entered ``safe`` by itself: a profile an operator chose
  (``--profile``, ``POST /admin/profile``: reason ``operator``) stays until changed.

No torch, no engine imports: the engine feeds it counts and applies what it returns.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

NORMAL = "normal"
SAFE = "safe"

SwitchReason = Literal[
    "startup", "operator", "fault_burst", "unrecoverable_fault", "invariant_violation",
    "clean_period",
]  # fmt: skip
#: Integrity levels the engine can move between at runtime: both keep the same
#: checksums and tags (``strict`` only checks more often). The others keep less state,
#: so a switch into or out of them would check against state nobody kept.
RUNTIME_INTEGRITY_LEVELS = ("standard", "strict")
_LEVELS = ("off", "audit", "standard", "strict")


class ProfileError(ValueError):
    """A profile or profiles file is invalid, or names an unknown profile."""


@dataclass(frozen=True)
class Profile:
    """The settings a profile changes; None keeps the configured value."""

    name: str
    integrity: str | None = None  # standard | strict (see RUNTIME_INTEGRITY_LEVELS)
    max_num_seqs: int | Literal["floor"] | None = None  # a cap on the batch
    preemption_mode: str | None = None  # recompute | swap
    scrub_blocks_per_step: int | None = None
    audit_interval: int | None = None
    prefix_cache: Literal["keep", "verified"] | None = None

    def __post_init__(self) -> None:
        where = f"profile {self.name!r}"
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ProfileError(f"{where}: a name is letters, digits, '-' and '_'")
        if self.integrity is not None and self.integrity not in _LEVELS:
            raise ProfileError(f"{where}: integrity must be one of {', '.join(_LEVELS)}")
        seqs = self.max_num_seqs
        if seqs is not None and seqs != "floor" and not (isinstance(seqs, int) and seqs >= 1):
            raise ProfileError(f"{where}: max_num_seqs is a positive integer or 'floor'")
        if self.preemption_mode not in (None, "recompute", "swap"):
            raise ProfileError(f"{where}: preemption_mode must be 'recompute' or 'swap'")
        for key in ("scrub_blocks_per_step", "audit_interval"):
            value = getattr(self, key)
            low = 0 if key == "scrub_blocks_per_step" else 1
            if value is not None and not (isinstance(value, int) and value >= low):
                raise ProfileError(f"{where}: {key} must be an integer >= {low}")
        if self.prefix_cache not in (None, "keep", "verified"):
            raise ProfileError(f"{where}: prefix_cache must be 'keep' or 'verified'")


@dataclass(frozen=True)
class ProfileSettings:
    """Every switchable setting with a concrete value: what the engine applies."""

    integrity: str
    max_num_seqs: int
    preemption_mode: str
    scrub_blocks_per_step: int
    audit_interval: int
    prefix_cache: Literal["keep", "verified"] = "keep"


def builtin_safe(base: ProfileSettings) -> Profile:
    """The built-in ``safe`` profile for an engine configured as ``base``."""
    return Profile(
        SAFE,
        integrity="strict" if base.integrity in RUNTIME_INTEGRITY_LEVELS else None,
        max_num_seqs="floor",
        preemption_mode="recompute",
        scrub_blocks_per_step=max(16, 4 * base.scrub_blocks_per_step),
        audit_interval=min(8, base.audit_interval),
        prefix_cache="verified",
    )


def resolve(
    profile: Profile, base: ProfileSettings, floor: int, has_host_tier: bool
) -> ProfileSettings:
    """``profile`` applied to the configured settings ``base``; ``floor`` is the batch
    controller's floor. Raises ``ProfileError`` for a setting the engine cannot reach."""
    where = f"profile {profile.name!r}"
    level = profile.integrity or base.integrity
    if level != base.integrity and not (
        level in RUNTIME_INTEGRITY_LEVELS and base.integrity in RUNTIME_INTEGRITY_LEVELS
    ):
        raise ProfileError(
            f"{where}: integrity {level!r} cannot be switched to from {base.integrity!r} at "
            f"runtime (only between {' and '.join(RUNTIME_INTEGRITY_LEVELS)}); start the "
            f"engine with --integrity standard or drop the setting"
        )
    seqs = profile.max_num_seqs
    cap = floor if seqs == "floor" else base.max_num_seqs if seqs is None else seqs
    if not isinstance(cap, int) or cap > base.max_num_seqs:
        raise ProfileError(
            f"{where}: max_num_seqs {seqs} exceeds the configured maximum {base.max_num_seqs}"
        )
    mode = profile.preemption_mode or base.preemption_mode
    if mode == "swap" and not has_host_tier:
        raise ProfileError(f"{where}: preemption_mode 'swap' needs a host tier (--swap-space)")
    return ProfileSettings(
        integrity=level,
        max_num_seqs=max(cap, 1),
        preemption_mode=mode,
        scrub_blocks_per_step=_pick(profile.scrub_blocks_per_step, base.scrub_blocks_per_step),
        audit_interval=_pick(profile.audit_interval, base.audit_interval),
        prefix_cache=profile.prefix_cache or "keep",
    )


def _pick(value: int | None, default: int) -> int:
    return default if value is None else value


def load_profiles_file(path: str | Path) -> dict[str, Profile]:
    """The profiles a YAML (``.yaml``/``.yml``), JSON or TOML file defines."""
    path = Path(path)
    text = path.read_text()
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ProfileError(
                f"{path}: reading YAML needs PyYAML (pip install pyyaml); or write the "
                f"profiles as JSON or TOML"
            ) from None
        data = yaml.safe_load(text)
    elif suffix == ".toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            raise ProfileError(f"{path}: TOML needs Python 3.11+; use JSON or YAML") from None
        data = tomllib.loads(text)
    elif suffix == ".json":
        data = json.loads(text)
    else:
        raise ProfileError(f"{path}: a profiles file ends in .yaml, .yml, .json or .toml")
    return parse_profiles(data, str(path))


def parse_profiles(data: Any, source: str = "profiles") -> dict[str, Profile]:
    """Profiles from a parsed file: ``{"profiles": {name: {setting: value}}}``."""
    if not isinstance(data, Mapping) or set(data) != {"profiles"}:
        raise ProfileError(f"{source}: expected one top-level key, 'profiles'")
    known = {f.name for f in fields(Profile)} - {"name"}
    profiles = {}
    for name, settings in (data["profiles"] or {}).items():
        if name == NORMAL:
            raise ProfileError(f"{source}: 'normal' is the configured engine; set engine flags")
        if not isinstance(settings, Mapping):
            raise ProfileError(f"{source}: profile {name!r} must map settings to values")
        unknown = set(settings) - known
        if unknown:
            raise ProfileError(
                f"{source}: profile {name!r} has unknown settings {sorted(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        profiles[str(name)] = Profile(str(name), **settings)
    return profiles


# ------------------------------------------------------------------ switching
@dataclass(frozen=True)
class SafeModePolicy:
    """When the engine rolls back to ``safe`` and when it comes back."""

    faults: int = 3  # detected faults ...
    window_s: float = 10.0  # ... within this many seconds trigger safe mode
    clean_period_s: float = 30.0  # seconds without a fault before leaving it
    auto: bool = True

    def __post_init__(self) -> None:
        if self.faults < 1:
            raise ProfileError(f"safe_mode_faults must be >= 1, got {self.faults}")
        if not self.window_s > 0 or self.clean_period_s < 0:
            raise ProfileError("safe_mode_window must be > 0 and safe_mode_clean_period >= 0")


@dataclass(frozen=True)
class ProfileSwitch:
    """One switch, with what caused it."""

    old: str
    new: str
    reason: SwitchReason
    detail: str


@dataclass(frozen=True)
class ProfileState:
    """The active profile as the engine reports it (``/health``, metrics)."""

    active: str = NORMAL
    reason: str = "startup"
    detail: str = ""
    since_s: float = 0.0  # seconds the active profile has been in force
    profiles: tuple[str, ...] = (NORMAL, SAFE)
    # (from, to, reason) -> switches
    switches: dict[tuple[str, str, str], int] = field(default_factory=dict)


class ProfileController:
    """Decides profile switches from per-step fault counts (module docstring)."""

    def __init__(
        self,
        names: tuple[str, ...],
        policy: SafeModePolicy,
        start: str = NORMAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.names = names
        self.policy = policy
        self.clock = clock
        self.check(start)
        self.active = start
        self.reason: str = "startup"
        self.detail = ""
        self.since = clock()
        self._left: str | None = None  # the profile automatic safe mode left, while in it
        self._faults: deque[float] = deque()  # detection times within the window
        self._last_fault = self.since
        self.switches: dict[tuple[str, str, str], int] = {}

    def check(self, name: str) -> None:
        """Raise ``ProfileError`` unless ``name`` is a known profile."""
        if name not in self.names:
            raise ProfileError(f"unknown profile {name!r}; known: {', '.join(self.names)}")

    def observe(
        self, faults: int = 0, unrecoverable: int = 0, audit_failures: int = 0
    ) -> ProfileSwitch | None:
        """Feed one step's detections; returns the switch they (or the time) cause."""
        now = self.clock()
        window = self._faults
        if faults or unrecoverable or audit_failures:
            self._last_fault = now
            window.extend([now] * faults)
        while window and now - window[0] > self.policy.window_s:
            window.popleft()
        if self.active == SAFE:
            if self.due():
                return self._switch(
                    self._left or NORMAL,
                    "clean_period",
                    f"no fault for {now - self._last_fault:.1f} s",
                )
            return None
        if not self.policy.auto:
            return None
        if unrecoverable:
            reason: SwitchReason = "unrecoverable_fault"
            detail = f"{unrecoverable} request(s) failed: no healthy KV left"
        elif audit_failures:
            reason, detail = "invariant_violation", f"{audit_failures} invariant violation(s)"
        elif len(window) >= self.policy.faults:
            reason = "fault_burst"
            detail = f"{len(window)} faults within {self.policy.window_s:g} s"
        else:
            return None
        left = self.active
        switch = self._switch(SAFE, reason, detail)
        self._left = left
        return switch

    def due(self) -> bool:
        """True when automatic safe mode has been clean long enough to end."""
        return (
            self.active == SAFE
            and self._left is not None
            and self.clock() - self._last_fault >= self.policy.clean_period_s
        )

    def request(self, name: str) -> ProfileSwitch | None:
        """An operator's choice: switch to ``name`` and stay there until told."""
        self.check(name)
        self._left = None
        if name == self.active:
            return None
        return self._switch(name, "operator", "requested by an operator")

    def _switch(self, new: str, reason: SwitchReason, detail: str) -> ProfileSwitch:
        switch = ProfileSwitch(self.active, new, reason, detail)
        key = (self.active, new, reason)
        self.switches[key] = self.switches.get(key, 0) + 1
        self.active, self.reason, self.detail = new, reason, detail
        self.since = self.clock()
        self._left = None
        self._faults.clear()
        return switch

    def state(self) -> ProfileState:
        return ProfileState(
            active=self.active,
            reason=self.reason,
            detail=self.detail,
            since_s=self.clock() - self.since,
            profiles=self.names,
            switches=dict(self.switches),
        )


def with_builtins(base: ProfileSettings, user: Mapping[str, Profile]) -> dict[str, Profile]:
    """``normal``, ``safe`` (built in unless ``user`` redefines it), then ``user``'s."""
    profiles = {NORMAL: Profile(NORMAL), SAFE: builtin_safe(base)}
    profiles.update(user)
    return profiles


__all__ = [
    "NORMAL",
    "SAFE",
    "Profile",
    "ProfileController",
    "ProfileError",
    "ProfileSettings",
    "ProfileState",
    "ProfileSwitch",
    "SafeModePolicy",
    "load_profiles_file",
    "parse_profiles",
    "resolve",
    "with_builtins",
]

"""Bring-up timelines to compare (``k3launch timeline NAME --compare OTHER``): a deployment's, from
its record in the state directory, or one saved to a file (:mod:`k3launch.models.bringups`); and
the last restart a supervisor recorded in the deployment's event log (``timeline NAME --restart``)."""

from __future__ import annotations

from pathlib import Path

from k3launch.api._common import store
from k3launch.errors import K3Error
from k3launch.models.bringups import SAVE_HINT, WRITTEN_BY, Saved, no_restart, no_timeline, read_saved, restarts
from k3launch.models.supervise import Event
from k3launch.util.names import is_name


def timeline(source: str, state_dir: str | Path | None = None) -> Saved:
    """The bring-up ``source`` names: the deployment of that name in the state directory (its
    record's timeline), else the file at that path — what ``k3launch timeline NAME --json`` printed,
    or a copy of a record. A deployment's name wins over a file of the same name (``./NAME`` is the
    file). Refusals: ``unknown-deployment``, ``no-timeline``, ``timeline-file`` (cannot be read),
    ``not-a-timeline``, ``bad-state`` (an unreadable record)."""
    st = store(state_dir)
    if is_name(source) and st.exists(source):
        rec = st.load(source)
        if rec.timeline is None:
            raise no_timeline(source, rec.state)
        return Saved(rec.timeline, rec.name)
    path = Path(source).expanduser()
    if is_name(source) and not path.exists():
        known = ", ".join(r.name for r in st.list()) or "none"
        raise K3Error("unknown-deployment", f"no deployment named {source!r} in {st.root}, and no file {source!r}",
                      f"deployments: {known}; or the path of {WRITTEN_BY}")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise K3Error("timeline-file", f"cannot read {source}: {exc.strerror or exc}",
                      f"a deployment's name, or the path of {WRITTEN_BY}") from None
    except UnicodeDecodeError:
        raise K3Error("not-a-timeline", f"{source} is not text (not UTF-8)", SAVE_HINT) from None
    return read_saved(text, source)


def restart_timeline(name: str, state_dir: str | Path | None = None) -> tuple[Event, Saved]:
    """The last restart of a unit of ``name`` a supervisor recorded (its event log, kept after
    ``down``): the ``restarted`` or ``restart-failed`` event, and the unit's timeline in it.
    Refusal: ``no-restart-timeline``."""
    from k3launch.api.supervision import events

    got = restarts(events(name, state_dir=state_dir))
    if not got or got[0].timeline is None:
        raise no_restart(name)
    return got[0], Saved(got[0].timeline, name)

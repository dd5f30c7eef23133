"""``gradsync status``'s text: a sync dir's description (``describe``) as lines to read."""

from __future__ import annotations

from typing import Any

__all__ = ["render"]


def render(report: dict[str, Any]) -> str:
    """The text of one sync dir's :func:`describe` report."""
    lines = [f"{report['sync_dir']}: {len(report['jobs'])} job(s), {report['disk_bytes']} bytes"]
    for job in report["jobs"]:
        lines += _job_lines(job)
    for run in report.get("joining", []):
        lines += _joining_lines(run)
    if report.get("error"):
        lines.append(f"  error: {report['error']}")
    return "\n".join(lines)


def _job_lines(job: dict[str, Any]) -> list[str]:
    # Jobs sharing a directory are told apart by their run ids.
    run = f" (run id {job['run_id']!r})" if isinstance(job.get("run_id"), str) else ""
    lines = [f"  generation {job['id']}{run}: {job['state']}, {job['disk_bytes']} bytes"]
    if job.get("error"):
        lines.append(f"    error: {job['error']}")
    for r in job["ranks"]:
        # Unknown: the data file of that call was rewritten (a later call, or in its place
        # something that is not one) before status read it.
        step = "unknown" if r.get("last_step") is None else r["last_step"]
        last = (
            f"last published call {r['last_call']} (step {step})"
            if "last_call" in r
            else "published nothing"
        )
        failed = ", FAILED a step" if r["failed"] else ""
        lines.append(
            f"    rank {r['rank']}: pid {r['pid']} on {r['host']}, {_life(job, r)}, {last}{failed}"
        )
    waiting = job.get("waiting")
    if waiting and waiting["what"] == "join":
        lines.append(f"    ranks {waiting['by']} are waiting for ranks {waiting['for']} to join")
    elif waiting:
        lines.append(
            f"    ranks {waiting['by']} are waiting for ranks {waiting['for']} to publish "
            f"their {waiting['what']} (call {waiting['call']})"
        )
    return lines


def _life(job: dict[str, Any], r: dict[str, Any]) -> str:
    """Whether a rank is alive (this host), beating (another host), or has left."""
    if r["left"]:
        return str(r.get("ended", "left"))
    if r["same_host"]:
        return "alive" if r["alive"] else "DEAD"
    if r.get("beating") is None:
        return (
            f"no beat seen in {r['sampled_s']:g} s (it beats every "
            f"{job['heartbeat_interval_s']:g} s)"
        )
    return "beating" if r.get("beating") else "NOT BEATING"


def _joining_lines(run: dict[str, Any]) -> list[str]:
    name = f"run id {run['run_id']!r}" if run["run_id"] is not None else "no run id"
    elastic = run.get("elastic", False)
    state = "asking to join the running elastic job" if elastic else "no rendezvous yet"
    lines = [f"  {name}: {state}"]
    for r in run["ranks"]:
        life = ("alive" if r["alive"] else "DEAD") if r["same_host"] else "on another host"
        lines.append(f"    rank {r['rank']}: pid {r['pid']} on {r['host']}, {life}")
    if run.get("waiting"):
        what = "its rank 0 to admit them" if elastic else "rank 0 to start the rendezvous"
        lines.append(f"    ranks {run['waiting']['by']} are waiting for {what}")
    return lines

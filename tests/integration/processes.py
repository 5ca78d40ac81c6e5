"""Several processes at once: stopping a swarm's peers, running refused command lines."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor


def stop_together(processes) -> None:
    """SIGTERM every process first, then wait for each: they stop (save, announce offline) side by
    side instead of one after the other, and none sees a partner vanish mid-stop for long."""
    for process in processes:
        process.terminate()
    for process in processes:
        process.stop()


def run_side_by_side(run, commands) -> dict[tuple, object]:
    """run(*command) for every command at once (each a CLI process that mostly starts Python and
    torch, then stops with an error): {tuple(command): its result}."""
    commands = [tuple(command) for command in commands]
    with ThreadPoolExecutor(max_workers=min(len(commands), 4)) as pool:  # 4: twice the cores CI has
        return dict(zip(commands, pool.map(lambda command: run(*command), commands)))

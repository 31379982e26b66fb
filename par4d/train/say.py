"""What ``par4d train`` prints as a line of its own, on any rank, flushed before the next process writes."""


def say(line: str) -> None:
    print(f"par4d train: {line}", flush=True)   # flushed: the ranks started next write to the same stdout

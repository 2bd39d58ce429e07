"""The benchmark leaderboard: suites of held-out task sets, policies, metrics with
confidence intervals, a results store and the pages (`python -m benchmarks.run`)."""

"""`nox -s cpu_e2e`, split by concern (the session itself is specgate.sessions.e2e.session):

- planning: the [e2e] settings and [[e2e.configs]] resolved to checkpoints, as plan.json;
- runs: which engines a test reads (one start per distinct engine) and their LLM arguments;
- compare: output comparisons and per-position acceptance;
- sampling: the statistics of the sampling checks (exact tails, sample sizes, acceptance e-values);
- report: what the tests record, merged into the summary's test entries;
- standin: upstream's own e2e file over a stand-in hub cache;
- review: what the session does with its history once its tests have run (drift, acceptance.svg).
"""

SESSION = "cpu_e2e"

"""`nox -s mutants`: realistic speculative-decoding faults injected into the engine process,
one at a time, to see which cpu_e2e checks catch them (specgate.sessions.mutants.session).

- the catalogue (specgate.vllmside.catalogue, beside the engine host that installs it): the
  faults, each a monkeypatch of a vLLM function, installed only in an engine process whose
  environment names it (MUTANT_VAR); never in a normal run;
- session: runs the fixture-mode cpu_e2e checks once per fault and reports the kills.
"""

SESSION = "mutants"
MUTANT_VAR = "SPECGATE_MUTANT"

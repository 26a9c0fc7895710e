"""Randomized, seeded fault-and-operator schedules against a real fleet (issue 12's test).

- :mod:`tests.chaos.cluster`: the fleet under test (its own Redis with AOF, the store, workers
  restarted by a supervisor, a sink worker) and the process tree the faults aim at;
- :mod:`tests.chaos.faults`: what goes wrong (kills, freezes, outages, lost Redis state);
- :mod:`tests.chaos.actions`: what an operator does (``python -m producer`` commands);
- :mod:`tests.chaos.invariants`: what must hold once the schedule settled and the remedy ran;
- :mod:`tests.chaos.schedule`: the model (a seed -> a list of timed steps);
  :mod:`tests.chaos.runner` plays one;
- :mod:`tests.chaos.soak`: ``make soak``, many schedules for a while, with a summary.
"""

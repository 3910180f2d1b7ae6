"""The `adaptive` scheduling strategy: `strategy.py` composes the scheduler's parts over the policy's cluster
view (queue, fairness, admission, placement, migration, prefetch); `planner.py` holds its planning state apart
from the queue (the step-cost fit, adapter popularity, what each worker is loading).
"""

"""The RL loop over Ray: rollout worker actors and a trainer actor, placed with a placement group.

Entry point: parity.distributed.driver.train_distributed(cfg, callbacks=None) -> summary, selected by
`python -m parity train distributed.enabled=true`. Only this package (and tracking) imports Ray."""

"""The Ray runner of the RL loop: rollout worker actors and trainer actor(s), placed with a placement group.

`python -m parity train distributed.enabled=true` (parity.training.loop.train) runs the loop with
parity.distributed.driver.ray_runner; parity.training.loop.train_distributed(cfg, callbacks=None) does so whatever the flag says.
Only this package (and tracking) imports Ray."""

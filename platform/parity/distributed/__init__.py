"""The Ray runner of the RL loop: rollout worker actors and trainer actor(s), placed with a placement group.

`python -m parity train distributed.enabled=true` (parity.commands.train) runs the loop with
parity.distributed.driver.ray_runner. Only this package (and tracking) imports Ray."""

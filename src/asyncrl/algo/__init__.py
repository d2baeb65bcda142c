"""RL math: advantages, the policy loss, reward shaping, the sampler's cut, and their
config sections. Pure functions; no transport, no engine. Import from the modules:
:mod:`~asyncrl.algo.advantages`, :mod:`~asyncrl.algo.loss`, :mod:`~asyncrl.algo.shaping`
(no torch, for the buffer), :mod:`~asyncrl.algo.truncation`, :mod:`~asyncrl.algo.config`."""

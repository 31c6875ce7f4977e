"""Stage implementations (rollout engines, reward functions, buffers, trainers); shipped as rlflow.stages."""

"""The engine core that shmclient talks to: config, scheduler, models, process main."""

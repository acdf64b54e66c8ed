"""shmclient: a same-host EngineCoreClient whose data travels through shared memory."""

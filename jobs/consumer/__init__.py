"""The consumer side of the job protocol: what a worker reads and writes in Redis.

``commands.py`` holds the stateless round trips (read, claim, record, bump, requeue, screen, beat,
cancel feed); ``session.py``'s ``ConsumerSession`` holds one worker's connection, identity, heartbeat,
cancel feed and outbox, and is all a worker talks to: ``worker/`` imports no Redis. (Nothing is
imported here: jobs/store.py and jobs/submit.py use ``commands`` without loading the session.)
"""

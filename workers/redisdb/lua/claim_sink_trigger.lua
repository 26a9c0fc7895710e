-- Every batch done, and not yet triggered: mark the job's sink queued. One script for the
-- batch task and the CLI, so the check and the claim cannot drift apart.
-- KEYS: done, the trigger's mark, the sink's state; ARGV: batches, dedup window (s), now.
-- 1: the caller enqueues the sink, 0: not complete or triggered already.
if redis.call('SCARD', KEYS[1]) < tonumber(ARGV[1]) then return 0 end
if not redis.call('SET', KEYS[2], '1', 'NX', 'EX', ARGV[2]) then return 0 end
redis.call('HSET', KEYS[3], 'state', 'queued', 'request', '', 'at', ARGV[3])
return 1

-- The owner's last step, after its results are in the store: 0 if it no longer owns the batch.
-- KEYS: done, progress, owner; ARGV: batch, token.
if redis.call('GET', KEYS[3]) ~= ARGV[2] then return 0 end
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('DEL', KEYS[2])
redis.call('DEL', KEYS[3])
return 1

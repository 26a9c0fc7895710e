-- Replace a batch's contribution to the job's counters by ARGV's (field, value) pairs.
-- KEYS: stats, bstats; ARGV: batch, then field, value per counter.
for i = 2, #ARGV, 2 do
  local f = ARGV[1] .. '|' .. ARGV[i]
  local new = tonumber(ARGV[i + 1])
  local old = tonumber(redis.call('HGET', KEYS[2], f) or '0')
  if new ~= old then redis.call('HINCRBY', KEYS[1], ARGV[i], new - old) end
  if new == 0 then redis.call('HDEL', KEYS[2], f) else redis.call('HSET', KEYS[2], f, new) end
end
return 1

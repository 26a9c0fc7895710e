-- Move kombu's visibility lease of each held delivery to Redis's now (see
-- workers/delivery/lease.py). Those whose batch this worker's pool owns are renewed (and
-- written back if another copy's ack removed them); any other only while its entry exists.
-- KEYS: unacked_index, unacked; ARGV: owner-token prefix of this worker's pool, then
-- (tag, owner key or '', kombu's unacked value) per held delivery. Returns the entries moved.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local n = 0
for i = 2, #ARGV, 3 do
  local tag, okey = ARGV[i], ARGV[i + 1]
  local owner = false
  if okey ~= '' then owner = redis.call('GET', okey) end
  if owner and string.sub(owner, 1, #ARGV[1]) == ARGV[1] then
    if redis.call('HEXISTS', KEYS[2], tag) == 0 then
      redis.call('HSET', KEYS[2], tag, ARGV[i + 2])
    end
    redis.call('ZADD', KEYS[1], now, tag)
    n = n + 1
  else
    n = n + redis.call('ZADD', KEYS[1], 'XX', 'CH', now, tag)
  end
end
return n

-- A token-checked key: keep it if it holds our token (extend it), else take it if it is free,
-- unless the optional set holds the member (a batch already done).
-- KEYS: the key[, a set]; ARGV: token, ttl ms[, member]. 1: ours now, 0: held by another
-- (or blocked).
local cur = redis.call('GET', KEYS[1])
if cur == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if cur then return 0 end
if #KEYS > 1 and redis.call('SISMEMBER', KEYS[2], ARGV[3]) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1

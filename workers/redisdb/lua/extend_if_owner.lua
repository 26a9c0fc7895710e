-- Extend a token-checked key only while it holds our token.
-- KEYS: the key; ARGV: token, ttl ms. 1: extended, 0: not ours (or gone).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0

-- Delete a token-checked key only while it holds our token (or value).
-- KEYS: the key; ARGV: token. 1: deleted, 0: not ours (or gone).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0

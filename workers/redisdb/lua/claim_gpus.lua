-- Own every GPU key as ARGV[1], all or none: the first key another node holds wins the
-- refusal ({index, owner}); else every key is (re)set and {} returned.
-- KEYS: the GPUs' owner keys; ARGV: node, ttl ms.
for i, key in ipairs(KEYS) do
  local owner = redis.call('GET', key)
  if owner and owner ~= ARGV[1] then return {i, owner} end
end
for i, key in ipairs(KEYS) do redis.call('SET', key, ARGV[1], 'PX', ARGV[2]) end
return {}

-- Drop the GPU keys ARGV[1] owns. KEYS: the GPUs' owner keys; ARGV: node. Returns how many.
local n = 0
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then n = n + redis.call('DEL', key) end
end
return n

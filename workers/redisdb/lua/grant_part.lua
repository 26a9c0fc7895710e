-- The batch's owner gives an idle GPU's request the unit keys in ARGV as a part.
-- KEYS: owner, request, part, part rows, parts, the job's hash
-- ARGV: owner token, the request as read, part claim TTL (ms), part id, parts TTL (s),
--       unit keys...
-- -1: the caller does not own the batch; 0: the request changed or is gone; 1: granted (the
-- job's hash counts it: parts_granted, rows_split).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
if redis.call('GET', KEYS[2]) ~= ARGV[2] then return 0 end
local req = cjson.decode(ARGV[2])
redis.call('DEL', KEYS[2])
redis.call('SET', KEYS[3], req['token'], 'PX', ARGV[3])
for i = 6, #ARGV do redis.call('SADD', KEYS[4], ARGV[i]) end
redis.call('SADD', KEYS[5], ARGV[4])
redis.call('EXPIRE', KEYS[4], ARGV[5])
redis.call('EXPIRE', KEYS[5], ARGV[5])
redis.call('HINCRBY', KEYS[6], 'parts_granted', 1)
redis.call('HINCRBY', KEYS[6], 'rows_split', #ARGV - 5)
return 1
